/* Text boxes with a maxlength: the browser cuts a longer paste without a word. Say so beside the box, with the
   limit, and take the note away once the text is under the limit again. Every page (templates/base.html). */
(() => {
  "use strict";
  const kv = window.kv;

  function note(box) {
    let p = box.nextElementSibling;
    if (!p || !p.classList.contains("limit-note")) {
      p = kv.el("p", { class: "note limit-note", role: "status" });
      box.after(p);
    }
    return p;
  }

  document.addEventListener("paste", (e) => {
    const box = e.target;
    if (!(box instanceof HTMLTextAreaElement) || box.maxLength <= 0) return;
    const pasted = (e.clipboardData && e.clipboardData.getData("text")) || "";
    const room = Math.max(0, box.maxLength - (box.value.length - (box.selectionEnd - box.selectionStart)));
    if (pasted.length <= room) return;
    const p = note(box);
    p.textContent = kv.t("js.limit.pasted_cut", { n: kv.int(pasted.length), kept: kv.int(room), limit: kv.int(box.maxLength) });
    p.hidden = false;
  });

  document.addEventListener("input", (e) => {
    const box = e.target;
    if (!(box instanceof HTMLTextAreaElement) || box.maxLength <= 0 || box.value.length >= box.maxLength) return;
    const p = box.nextElementSibling;
    if (p && p.classList.contains("limit-note")) p.hidden = true;
  });
})();
