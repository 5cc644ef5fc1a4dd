/* Activation patching: a map followed through the server's line (kv.follow: place, then "forwards done of N",
   Stop), then its numbers from /api/patch/run (the finished result: no second run) drawn as a Plotly heatmap.
   Hover: the exact number and what was patched; click: Inspect on the clean prompt at that block, head, position. */
window.kv.page("patch", (page) => {
  "use strict";
  const kv = window.kv, $ = kv.$;
  const presets = JSON.parse($("patch-presets").textContent);
  const form = $("patch-form");
  const FIELDS = ["clean", "corrupted", "answer", "wrong"];

  function usePreset(id) {
    const p = presets.find((x) => x.id === id);
    if (!p) return;
    FIELDS.forEach((f) => { $("patch-" + f).value = p[f]; });
  }
  function showOneHead() { $("patch-one-head").hidden = $("patch-kind").value !== "head_pos"; }

  function body() {
    const f = new FormData(form);
    const kind = f.get("kind");
    return {
      model: f.get("model") || null, clean: f.get("clean") || "", corrupted: f.get("corrupted") || "",
      answer: f.get("answer") || "", wrong: f.get("wrong") || "", metric: f.get("metric"),
      direction: f.get("direction"), kind: kind,
      layer: kind === "head_pos" ? Number(f.get("layer")) : null, head: kind === "head_pos" ? Number(f.get("head")) : null,
    };
  }

  function line(text, fraction, running) {
    $("patch-line").hidden = false;
    $("patch-line-text").textContent = text;
    const bar = $("patch-line-bar");
    if (fraction === null) bar.removeAttribute("value"); else bar.value = fraction;
    $("patch-stop").hidden = !running;
  }

  function fmt(x) { return x === null || x === undefined ? "—" : kv.fmt(x, 3); }

  /* What one cell patched, in words (hover) and where Inspect opens for it. */
  function cellOf(d, row, col) {
    if (d.kind === "head") return { layer: row, head: col, q: d.n_tokens - 1, pos: null };
    if (d.kind === "head_pos") return { layer: d.layer, head: d.head, q: col, pos: col };
    return { layer: row, head: 0, q: col, pos: col };
  }
  function whatText(d, c) {
    return kv.t("patch.what." + d.kind, { layer: c.layer, head: c.head, pos: c.pos,
      token: c.pos === null ? "" : d.clean_tokens[c.pos] });
  }

  async function draw(d) {
    $("patch-empty").hidden = true;
    const summary = $("patch-summary");
    summary.hidden = false;
    summary.textContent = kv.t(d.metric === "prob" ? "patch.summary.prob" : "patch.summary", {
      clean: fmt(d.clean_metric), corrupted: fmt(d.corrupted_metric), answer: d.answer.used, wrong: d.wrong.used,
      forwards: d.forwards,
    });
    const notes = $("patch-notes");
    notes.replaceChildren();
    [["answer", d.answer], ["wrong", d.wrong]].forEach(([field, a]) => {
      if (a.pieces > 1) notes.append(kv.el("li", {}, kv.t("patch.answer.first", { typed: a.typed, used: a.used, n: a.pieces })));
      notes.append(kv.el("li", { class: "patch-scored", "data-field": field },
        kv.t("patch.answer.scored", { typed: a.typed, used: a.used, id: a.id })));
      if (a.spaced) {  // typed without its leading space: say the space matters, offer the token a preset scores
        const use = kv.el("button", { type: "button", class: "patch-use-space", "data-field": field },
          kv.t("patch.answer.use_space", { used: a.spaced.used }));
        use.addEventListener("click", () => {
          $("patch-" + field).value = a.spaced.text;
          form.querySelector("input[value=own]").checked = true;
          run();
        });
        notes.append(kv.el("li", { class: "patch-space", "data-field": field },
          kv.t("patch.answer.space", { typed: a.typed, used: a.used, id: a.id, spaced: a.spaced.used, spaced_id: a.spaced.id }),
          " ", use));
      }
    });
    notes.append(kv.el("li", {}, kv.t("patch.differ", {
      positions: d.differ.map((p) => p + " " + d.clean_tokens[p] + " → " + d.corrupted_tokens[p]).join(", ") })));
    const means = $("patch-means");
    means.hidden = false;
    means.textContent = d.metric === "prob" ? kv.t("patch.prob.means")
      : kv.t("patch.direction." + d.direction + ".means");

    const Plotly = await kv.plotly();
    const text = d.z.map((row, r) => row.map((_, c) => whatText(d, cellOf(d, r, c))));
    const custom = d.raw.map((row) => row.map((x) => fmt(x)));
    const colour = d.metric === "prob" ? kv.t("patch.colour.prob") : kv.t("patch.colour.normalized");
    const xTitle = d.kind === "head" ? kv.t("patch.axis.head") : kv.t("patch.axis.position");
    const hover = kv.t("patch.hover.cell") + " %{z:.3f}<br>%{text}<br>" + kv.t("patch.hover.raw") + " %{customdata}<extra></extra>";
    const rows = d.rows.length;
    const el = $("patch-map");
    const trace = {
      z: d.z, x: d.columns, y: d.rows, text: text, customdata: custom, type: "heatmap", hovertemplate: hover,
      colorscale: "RdBu", reversescale: true, zmid: d.metric === "prob" ? undefined : 0,
      zmin: d.metric === "prob" ? 0 : undefined, zmax: d.metric === "prob" ? 1 : undefined,
      colorbar: { title: { text: colour, side: "right" } }, xgap: 1, ygap: 1,
    };
    Plotly.react(el, [trace], {
      margin: { l: 80, r: 20, t: 10, b: 110 }, font: kv.plotFont, height: Math.max(220, 18 * rows + 150),
      xaxis: { title: { text: xTitle }, type: "category", tickangle: -45, automargin: true },
      yaxis: { title: { text: kv.t("patch.axis.block") }, type: "category", autorange: "reversed", automargin: true },
    }, kv.PLOT_CONFIG);
    el.setAttribute("title", kv.t("patch.open_inspect"));
    if (el.removeAllListeners) el.removeAllListeners("plotly_click");
    el.on("plotly_click", (ev) => {
      const pt = ev.points && ev.points[0];
      if (!pt) return;
      const r = d.rows.indexOf(pt.y), c = d.columns.indexOf(pt.x);
      const cell = cellOf(d, r, c);
      const u = new URL(d.inspect, window.location.origin);
      u.searchParams.set("layer", cell.layer);
      u.searchParams.set("head", cell.head);
      u.searchParams.set("q", cell.q);
      window.location.assign(u.pathname + u.search);
    });
  }

  let current = null;  // the run this page follows: { controller, job }

  async function run() {
    if (current) current.controller.abort();
    kv.clearError();
    const req = body();
    const me = { controller: new AbortController(), job: null };
    current = me;
    const last = await kv.followRun("/api/patch/jobs", req, me, { show: line, isCurrent: () => current === me, lineId: "patch-line" });
    if (current !== me) return;
    current = null;
    if (last && last.event === "done") {
      let d = null;
      try { d = await kv.postJSON("/api/patch/run", req); } catch (e) { d = null; }
      if (d && d.z) await draw(d);
    }
  }

  async function stop() {
    const me = current;
    if (!me) return;
    current = null;
    if (me.job) await kv.forget("/api/patch/jobs/" + encodeURIComponent(me.job));
    me.controller.abort();
    line(kv.t("js.lab.stopped"), null, false);
  }

  form.querySelectorAll("input[name=preset]").forEach((r) => r.addEventListener("change", () => {
    if (r.checked && r.value !== "own") usePreset(r.value);
  }));
  FIELDS.forEach((f) => $("patch-" + f).addEventListener("input", () => { form.querySelector("input[value=own]").checked = true; }));
  $("patch-kind").addEventListener("change", showOneHead);
  form.addEventListener("submit", (e) => { e.preventDefault(); run(); });
  $("patch-stop").addEventListener("click", stop);
  const checked = form.querySelector("input[name=preset]:checked");
  if (checked) usePreset(checked.value);
  showOneHead();
});
