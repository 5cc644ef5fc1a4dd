/* Long prompts on Inspect: paste, a .txt file (checked against its size limit before it is sent) or the built-in
   long text, captured in the long-capture line (POST /api/long/jobs, followed with kv.follow: place in line, then
   "layer n of L"), Stop (DELETE the job, then close the connection); when it is done the zoom page opens.
   While it runs, the capture is watched as it climbs: each layer's overview (its most telling head, the zoom page's
   opening tile: GET /api/long/jobs/{job}/layers/{layer}, one byte a cell on the √ scale) is drawn as soon as the
   followed progress says it is ready (progress.climbed). */
(function () {
  "use strict";
  const kv = window.kv;

  /* The painter of one capture's climb into #long-climb: `more(job, n)` fetches and draws the layers below n not
     drawn yet, one after the other; `clear()` empties it (a new capture, or one that stopped). */
  function climbPainter() {
    const box = document.getElementById("long-climb"), grid = document.getElementById("long-climb-grid");
    const axes = document.getElementById("long-climb-axes");
    let drawn = 0, busy = false, want = 0, job = null, gen = 0;
    // byte b -> the colour of the weight (b / 255)² on the √ scale, as on the zoom page
    const lut = [];
    for (let b = 0; b < 256; b++) lut.push(kv.weightColour(kv.SCALES.sqrt.f(kv.fromSqrtU8(b))));

    function caption(h) {
      const role = h.role === "previous" ? kv.t("js.long.climb.previous", { w: (+h.score).toFixed(2) })
        : h.role === "reader" ? kv.t("js.long.climb.reader", { k: h.key, w: (+h.score).toFixed(2) })
          : kv.t("js.long.climb.none");
      return [kv.t("js.long.climb.head", { layer: h.layer, head: h.head }), role];
    }

    function paint(h, bytes) {
      const c = document.createElement("canvas");
      c.width = h.cols; c.height = h.rows;
      const ctx = c.getContext("2d"), img = ctx.createImageData(h.cols, h.rows), d = img.data, m = kv.MASK_RGB;
      for (let i = 0; i < h.rows; i++) {
        for (let j = 0; j < h.cols; j++) {
          const o = 4 * (i * h.cols + j), b = bytes[i * h.cols + j];
          // a cell whose every key is after its every query is the causal mask's (weight 0 by construction)
          const rgb = j * h.f > i * h.f + h.f - 1 ? m : lut[b];
          d[o] = rgb[0]; d[o + 1] = rgb[1]; d[o + 2] = rgb[2]; d[o + 3] = 255;
        }
      }
      ctx.putImageData(img, 0, 0);
      const [head, role] = caption(h);
      c.setAttribute("role", "img");
      c.setAttribute("aria-label", `${head}. ${role}. ${kv.t("js.long.climb.axes")}`);
      const fig = document.createElement("figure"), cap = document.createElement("figcaption");
      fig.className = "long-climb-layer";
      fig.dataset.layer = h.layer;
      const b = document.createElement("b");
      b.textContent = head;
      cap.append(b, document.createTextNode(role));
      fig.append(c, cap);
      grid.append(fig);
    }

    async function pump(mine) {
      busy = true;
      try {
        while (mine === gen && drawn < want) {
          const r = await fetch(`/api/long/jobs/${job}/layers/${drawn}`, { headers: { "X-KVScope-Lang": kv.lang } });
          if (mine !== gen) return;
          if (!r.ok) return;  // stopped meanwhile: the form says so
          const g = (name) => r.headers.get(name);
          const h = { layer: +g("X-Layer"), head: +g("X-Head"), role: g("X-Role"), score: g("X-Score"),
            key: g("X-Key"), f: +g("X-Factor"), tokens: +g("X-Tokens"), rows: +g("X-Tile-Rows"),
            cols: +g("X-Tile-Cols") };
          const bytes = new Uint8Array(await r.arrayBuffer());
          if (mine !== gen) return;
          paint(h, bytes);
          drawn += 1;
          if (box.hidden) {  // the first layer: the axes, once; bring the climb into view (the form above is tall)
            axes.textContent = kv.t("js.long.climb.scale", { last: (h.tokens - 1).toLocaleString(kv.lang),
              f: h.f });
            box.hidden = false;
            box.scrollIntoView({ block: "nearest" });
          }
          document.body.dataset.longClimbed = drawn;
        }
      } catch (e) { /* the connection went: the form's follow says what happened */ } finally {
        if (mine === gen) busy = false;
      }
    }

    return {
      more(id, n) {
        if (id !== job) { this.clear(); job = id; box.dataset.job = id; }
        want = Math.max(want, n || 0);
        if (!busy && drawn < want) pump(gen);
      },
      clear() {
        gen += 1; drawn = 0; want = 0; job = null; busy = false;
        grid.textContent = axes.textContent = "";
        delete box.dataset.job;
        box.hidden = true;
        delete document.body.dataset.longClimbed;
      },
    };
  }

  function longForm() {
    const form = document.getElementById("long-form");
    if (!form || form.dataset.bound) return;
    form.dataset.bound = "1";
    const text = document.getElementById("long-text"), file = document.getElementById("long-file");
    const bar = document.getElementById("long-bar"), status = document.getElementById("long-status");
    const box = document.getElementById("long-progress"), run = document.getElementById("long-run");
    const maxBytes = +form.dataset.maxBytes, climb = climbPainter();
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
      climb.clear();
      status.textContent = kv.t("js.long.sending");
      try {
        const last = await kv.follow("/api/long/jobs", body, (ev) => {
          job = ev.job || job;
          status.textContent = ev.text || "";
          if (ev.event === "running") {
            bar.value = ev.fraction || 0;
            if (ev.progress && ev.progress.climbed) climb.more(job, ev.progress.climbed);
          }
          if (ev.event === "done") bar.value = 1;
        }, ctl.signal);
        if (last && last.event === "done" && last.result) { kv.visit(last.result.url); return; }
        if (last && last.event !== "done") climb.clear();  // stopped or failed: none of it is kept
      } catch (err) {
        climb.clear();
        if (ctl.signal.aborted) status.textContent = kv.t("js.long.stopped");
        else box.hidden = true;
      } finally {
        run.disabled = false; ctl = null;
      }
    });
  }

  /* A long trace the server dropped (templates/zoom_gone.html): nothing ran yet; the button captures it again
     in the line, followed (and its climb drawn) as above, then opens its page. */
  function again() {
    const run = document.getElementById("zoom-gone-run");
    if (!run || run.dataset.bound) return;
    run.dataset.bound = "1";
    const box = document.getElementById("zoom-gone-progress"), bar = document.getElementById("zoom-gone-bar");
    const status = document.getElementById("zoom-gone-status"), climb = climbPainter();
    let job = null, ctl = null;
    document.getElementById("zoom-gone-stop").addEventListener("click", async () => {
      if (job) { try { await kv.request("DELETE", `/api/long/jobs/${job}`); } catch (e) { /* shown */ } }
      if (ctl) ctl.abort();
    });
    run.addEventListener("click", async () => {
      kv.clearError();
      ctl = new AbortController(); job = null;
      box.hidden = false; bar.value = 0; run.disabled = true;
      climb.clear();
      status.textContent = kv.t("js.long.sending");
      try {
        const last = await kv.follow("/api/long/jobs", { key: run.dataset.key }, (ev) => {
          job = ev.job || job;
          status.textContent = ev.text || "";
          if (ev.event === "running") {
            bar.value = ev.fraction || 0;
            if (ev.progress && ev.progress.climbed) climb.more(job, ev.progress.climbed);
          }
          if (ev.event === "done") bar.value = 1;
        }, ctl.signal);
        if (last && last.event === "done" && last.result) { kv.visit(last.result.url + location.search); return; }
        if (last && last.event !== "done") climb.clear();
      } catch (err) {
        climb.clear();
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
