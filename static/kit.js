/* /kit: the class kit's page is server-rendered (htmx swaps the list after a delete). This script writes each pin's
   time in the reader's own clock and language, copies a pin's full link for the class, and upper-cases a code as
   it is typed (the server accepts any case). */
window.kv.page("kit", (page) => {
  "use strict";
  const when = new Intl.DateTimeFormat(kv.lang === "zh" ? "zh-CN" : "en", { dateStyle: "medium", timeStyle: "short" });
  function drawList(list) {
    list.querySelectorAll("time[data-created]").forEach((t) => {
      const d = new Date(1000 * +t.dataset.created);
      t.dateTime = d.toISOString();
      t.textContent = when.format(d);
    });
  }
  page.view("kit-list", drawList);
  document.addEventListener("click", async (e) => {
    const b = e.target.closest && e.target.closest(".kit-copy");
    if (!b) return;
    const url = new URL(b.dataset.href, window.location.href).toString();
    try {
      await navigator.clipboard.writeText(url);
      b.textContent = kv.t("js.kit.copied");
    } catch (err) {
      b.textContent = url;  // no clipboard (an http page on another machine): the link to read out instead
    }
  });
  const input = kv.$("kit-code-input");
  if (input) input.addEventListener("input", () => { input.value = input.value.toUpperCase(); });
});
