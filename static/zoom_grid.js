/* The grid of heads on the long-prompt page (templates/zoom.html): layers × heads, each square coloured by one
   summary of the head over the whole prompt (app/viz/summaries.py via /api/traces/{key}/heads/{layer}).

   A layer streams every exact weight of its heads on the server (seconds at 8 192 tokens), so the grid is
   computed on demand — "Compute the grid" asks layer 0, 1, … one at a time, with a progress bar and Pause; the
   server keeps each layer's numbers, so asking again costs nothing. Switching the measure only recolours.
   Clicking a square opens that head in the zoom map above (window.kvZoom). */
(function () {
  "use strict";
  const kv = window.kv;
  const FORMAT = { first: (v) => (v * 100).toFixed(1) + "%", distance: (v) => v.toFixed(1), entropy: (v) => v.toFixed(2) };

  function init() {
    const root = document.getElementById("zoom-grid");
    if (!root || root.dataset.bound) return;
    root.dataset.bound = "1";
    const key = root.dataset.key, L = +root.dataset.layers;
    const rows = new Array(L).fill(null);
    // the rows the server already holds (a pinned trace's: all it was pinned with) are drawn at once
    const kept = document.getElementById("zoom-grid-rows");
    if (kept) Object.entries(JSON.parse(kept.textContent)).forEach(([l, r]) => { if (+l < L) rows[+l] = r; });
    const $ = (id) => document.getElementById(id);
    const run = $("zoom-grid-run"), stop = $("zoom-grid-stop"), bar = $("zoom-grid-progress"), status = $("zoom-grid-status");
    let measure = "first", running = false;

    function paint() {
      const done = rows.filter(Boolean);
      const all = done.flatMap((r) => r[measure]).filter((v) => v !== null);
      const lo = measure === "first" ? 0 : Math.min(0, ...all), hi = measure === "first" ? 1 : Math.max(1e-9, ...all);
      root.querySelectorAll(".zg-cell").forEach((c) => {
        const l = +c.dataset.layer, h = +c.dataset.head, r = rows[l];
        const v = r ? r[measure][h] : null;
        if (v === null || v === undefined) {
          c.style.background = ""; c.style.color = ""; c.textContent = "";
          c.title = kv.t("js.zoomgrid.pending", { layer: l, head: h });
          delete c.dataset.value;
        } else {
          const [R, G, B] = kv.weightColour((v - lo) / (hi - lo));
          c.style.background = `rgb(${R},${G},${B})`;
          c.style.color = R * 0.3 + G * 0.59 + B * 0.11 < 140 ? "#fff" : "#111";
          c.textContent = FORMAT[measure](v);
          c.title = kv.t("js.zoomgrid.cell", { layer: l, head: h, value: FORMAT[measure](v) + (measure === "first" ? "" : " " + kv.t("js.zoomgrid.unit." + measure)) });
          c.dataset.value = String(v);
        }
        c.setAttribute("aria-label", c.title);
      });
      // The head that scores highest on this measure is outlined: the first place to look.
      const cells = [...root.querySelectorAll(".zg-cell[data-value]")];
      const top = cells.length ? cells.reduce((a, c) => (+c.dataset.value > +a.dataset.value ? c : a)) : null;
      cells.forEach((c) => c.classList.toggle("top", c === top));
      $("zoom-grid-range").textContent = all.length ? kv.t("js.zoomgrid.range", { lo: FORMAT[measure](lo), hi: FORMAT[measure](hi), unit: kv.t("js.zoomgrid.unit." + measure) }) : "";
      root.querySelectorAll(".zoom-grid-hint").forEach((p) => { p.hidden = p.dataset.measure !== measure; });
    }
    function select() {
      const z = window.kvZoom;
      root.querySelectorAll(".zg-cell").forEach((c) => c.classList.toggle("sel", !!z && +c.dataset.layer === z.layer && +c.dataset.head === z.head));
    }

    /* About how long: whole seconds up to a minute and a half, then minutes (as the server's lines say it). */
    function about(seconds) {
      return seconds < 90 ? kv.t("js.zoomgrid.seconds", { s: Math.max(1, Math.round(seconds)) })
        : kv.t("js.zoomgrid.minutes", { m: Math.round(seconds / 60) });
    }

    async function fill() {
      if (running) return;
      running = true; run.hidden = true; stop.hidden = false; bar.hidden = false;
      // The time left from this run's own pace: the layers computed so far, each a pass over all its weights, so
      // every layer costs about the same; said once one layer is in (before it, nothing is measured).
      const start = performance.now();
      let timed = 0;
      for (let l = 0; l < L && running; l++) {
        if (rows[l]) continue;
        bar.value = l;
        const left = rows.filter((r) => !r).length;  // this layer and those after it not yet in
        const per = timed ? (performance.now() - start) / timed / 1000 : null;
        status.textContent = per === null ? kv.t("js.zoomgrid.progress", { layer: l + 1, layers: L })
          : kv.t("js.zoomgrid.progress_eta", { layer: l + 1, layers: L, eta: about(per * left), per: about(per) });
        try { rows[l] = await kv.getJSON(`/api/traces/${key}/heads/${l}`); } catch (e) { running = false; break; }
        timed++;
        paint();
      }
      const done = rows.filter(Boolean).length;
      bar.value = done;
      status.textContent = done === L ? kv.t("js.zoomgrid.done", { layers: L }) : kv.t("js.zoomgrid.paused", { done, layers: L });
      running = false; run.hidden = done === L; stop.hidden = true; bar.hidden = done === L;
      document.body.dataset.zoomGridDone = String(done);
    }

    // While this page is open it says so (POST …/hold every data-heartbeat-s, for at most data-heartbeat-max-s):
    // the server holds its long trace meanwhile, and for Settings.trace_hold_s after. When the server has dropped
    // it anyway (for memory), the answer says so, with what capturing it again takes, beside "Keep for class".
    const every = +root.dataset.heartbeatS, most = +root.dataset.heartbeatMaxS, held = $("zoom-held");
    if (every > 0 && !root.dataset.pinned && held) {
      const started = Date.now();
      const beat = setInterval(async () => {
        if (Date.now() - started > most * 1000) { clearInterval(beat); return; }
        let r = null, data = null;
        try { r = await fetch(`/api/traces/${key}/hold`, { method: "POST", headers: { "X-KVScope-Lang": kv.lang } }); } catch (e) { return; }
        try { data = await r.json(); } catch (e) { data = null; }
        if (r.status === 410) {
          clearInterval(beat);
          held.textContent = (data && data.detail) || "";
          held.classList.add("zoom-dropped");
          document.body.dataset.traceDropped = "1";
        } else if (r.ok) {
          held.textContent = held.dataset.heldText;
          document.body.dataset.heartbeats = String(+(document.body.dataset.heartbeats || 0) + 1);
        }
      }, every * 1000);
    }

    run.addEventListener("click", fill);
    stop.addEventListener("click", () => { running = false; });
    root.querySelectorAll("input[name=zoom-measure]").forEach((el) => el.addEventListener("change", (e) => { measure = e.target.value; paint(); }));
    root.querySelector("#zoom-grid-cells").addEventListener("click", (e) => {
      const c = e.target.closest(".zg-cell");
      const z = window.kvZoom;
      if (!c || !z) return;
      z.select({ layer: +c.dataset.layer, head: +c.dataset.head });
      select();
      document.getElementById("zoom").scrollIntoView({ behavior: "smooth", block: "start" });
    });
    ["zoom-layer", "zoom-head"].forEach((id) => { const s = $(id); if (s) s.addEventListener("change", select); });
    paint();
    select();
    const have = rows.filter(Boolean).length;
    if (have) {
      bar.value = have;
      status.textContent = have === L ? kv.t("js.zoomgrid.done", { layers: L }) : kv.t("js.zoomgrid.paused", { done: have, layers: L });
      run.hidden = have === L;
      document.body.dataset.zoomGridDone = String(have);
    }
  }
  window.kv.page("inspect", () => setTimeout(init, 0));  // after zoom.js has made the map
})();
