/* Long prompts on Inspect: paste, a .txt file (checked against its size limit before it is sent) or the built-in
   long text, captured in the long-capture line (POST /api/long/jobs, followed with kv.follow: place in line, then
   "layer n of L"), Stop (DELETE the job, then close the connection); when it is done the zoom page opens. */
(function () {
  "use strict";
  const kv = window.kv;

  function longForm() {
    const form = document.getElementById("long-form");
    if (!form || form.dataset.bound) return;
    form.dataset.bound = "1";
    const text = document.getElementById("long-text"), file = document.getElementById("long-file");
    const bar = document.getElementById("long-bar"), status = document.getElementById("long-status");
    const box = document.getElementById("long-progress"), run = document.getElementById("long-run");
    const maxBytes = +form.dataset.maxBytes;
    let builtin = false, job = null, ctl = null;
    text.addEventListener("input", () => { builtin = false; });
    file.addEventListener("change", async () => {
      const f = file.files && file.files[0];
      if (!f) return;
      kv.clearError();
      if (f.size > maxBytes) {
        kv.showError(kv.t("js.long.too_big", { name: f.name, size: kv.bytes(f.size), limit: kv.bytes(maxBytes) }));
        file.value = "";
        return;
      }
      text.value = await f.text();
      document.getElementById("long-file-name").textContent = f.name;
      builtin = false;
    });
    document.getElementById("long-builtin").addEventListener("click", async () => {
      const sel = document.getElementById("long-model");
      const d = await kv.getJSON("/api/long/text" + (sel ? "?model=" + encodeURIComponent(sel.value) : ""));
      text.value = d.text;
      builtin = true;
    });
    document.getElementById("long-stop").addEventListener("click", async () => {
      if (job) { try { await kv.request("DELETE", `/api/long/jobs/${job}`); } catch (e) { /* shown */ } }
      if (ctl) ctl.abort();
    });
    form.addEventListener("submit", async (e) => {
      e.preventDefault();
      kv.clearError();
      const sel = document.getElementById("long-model");
      const body = builtin ? { builtin: true } : { prompt: text.value };
      if (sel) body.model = sel.value;
      ctl = new AbortController(); job = null;
      box.hidden = false; bar.value = 0; run.disabled = true;
      status.textContent = kv.t("js.long.sending");
      try {
        const last = await kv.follow("/api/long/jobs", body, (ev) => {
          job = ev.job || job;
          status.textContent = ev.text || "";
          if (ev.event === "running") bar.value = ev.fraction || 0;
          if (ev.event === "done") bar.value = 1;
        }, ctl.signal);
        if (last && last.event === "done" && last.result) { kv.visit(last.result.url); return; }
      } catch (err) {
        if (ctl.signal.aborted) status.textContent = kv.t("js.long.stopped");
        else box.hidden = true;
      } finally {
        run.disabled = false; ctl = null;
      }
    });
  }

  /* A long trace the server dropped (templates/zoom_gone.html): nothing ran yet; the button captures it again
     in the line, followed as above, then opens its page. */
  function again() {
    const run = document.getElementById("zoom-gone-run");
    if (!run || run.dataset.bound) return;
    run.dataset.bound = "1";
    const box = document.getElementById("zoom-gone-progress"), bar = document.getElementById("zoom-gone-bar");
    const status = document.getElementById("zoom-gone-status");
    let job = null, ctl = null;
    document.getElementById("zoom-gone-stop").addEventListener("click", async () => {
      if (job) { try { await kv.request("DELETE", `/api/long/jobs/${job}`); } catch (e) { /* shown */ } }
      if (ctl) ctl.abort();
    });
    run.addEventListener("click", async () => {
      kv.clearError();
      ctl = new AbortController(); job = null;
      box.hidden = false; bar.value = 0; run.disabled = true;
      status.textContent = kv.t("js.long.sending");
      try {
        const last = await kv.follow("/api/long/jobs", { key: run.dataset.key }, (ev) => {
          job = ev.job || job;
          status.textContent = ev.text || "";
          if (ev.event === "running") bar.value = ev.fraction || 0;
          if (ev.event === "done") bar.value = 1;
        }, ctl.signal);
        if (last && last.event === "done" && last.result) { kv.visit(last.result.url + location.search); return; }
      } catch (err) {
        if (ctl.signal.aborted) status.textContent = kv.t("js.long.stopped");
        else box.hidden = true;
      } finally {
        run.disabled = false; ctl = null;
      }
    });
  }

  kv.page("inspect", longForm);
  kv.page("inspect", again);
})();
