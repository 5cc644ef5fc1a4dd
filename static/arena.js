/* The compression arena: a run followed through the server's line, then its charts: KL per step (every policy),
   attention mass per layer × head and the kept map (one policy, picked in the select). The numbers come from
   the server in #arena-data, inside the result it renders (#arena-result: with the page, or swapped in). */
window.kv.page("arena", (page) => {
  "use strict";
  const kv = window.kv, $ = kv.$;

  async function draw(result) {
    const tag = result.querySelector("#arena-data");
    if (!tag) return;
    const data = JSON.parse(tag.textContent);
    const names = JSON.parse(result.querySelector("#arena-names").textContent);  // the policies' names, in the page's language
    const Plotly = await kv.plotly();
    const lines = data.policies.filter((p) => p.name !== "full").map((p) => ({
      x: p.kl.map((_, i) => i), y: p.kl, name: names[p.name], mode: "lines+markers", type: "scatter",
    }));
    Plotly.react("arena-kl", lines, {
      margin: { l: 60, r: 10, t: 10, b: 45 }, font: kv.plotFont, height: 320,
      xaxis: { title: { text: kv.t("js.arena.step") } }, yaxis: { title: { text: kv.t("js.arena.kl") }, rangemode: "tozero" },
      legend: { font: { size: 12 } },
    }, kv.PLOT_CONFIG);
    const pick = $("arena-pick");
    const one = () => drawPolicy(Plotly, data, data.policies[Number(pick.value)], names);
    pick.addEventListener("change", one);
    one();
  }

  function drawPolicy(Plotly, data, p, names) {
    const layers = [...Array(data.n_layer).keys()].map((l) => "L" + l);
    Plotly.react("arena-mass", [{
      z: p.mass, y: layers, x: [...Array(data.n_head).keys()].map((h) => "H" + h), type: "heatmap",
      zmin: 0, zmax: 1, colorscale: "Viridis", hovertemplate: "%{y} %{x}: %{z:.3f}<extra></extra>",
    }], { margin: { l: 45, r: 10, t: 10, b: 35 }, font: kv.plotFont, height: 320, yaxis: { autorange: "reversed" } },
    kv.PLOT_CONFIG);
    const z = p.keep.map((bits) => Array.from(bits, (c) => (c === "1" ? 1 : 0)));
    const n = z.length ? z[0].length : 0;
    const text = p.keep.map(() => data.labels.slice(0, n));
    Plotly.react("arena-keep", [{
      z: z, y: data.map_rows, type: "heatmap", zmin: 0, zmax: 1, showscale: false, text: text,
      colorscale: [[0, "#eef0f3"], [1, "#2f6fdf"]], xgap: n > 200 ? 0 : 1, ygap: 1,
      hovertemplate: "%{y} · pos %{x} %{text}: %{z}<extra></extra>",
    }], {
      margin: { l: 70, r: 10, t: 10, b: 40 }, font: kv.plotFont, height: Math.max(160, 22 * z.length + 60),
      xaxis: { title: { text: kv.t("js.arena.position") } }, yaxis: { autorange: "reversed" },
    }, kv.PLOT_CONFIG);
    const label = $("arena-keep-label");
    if (label) label.textContent = names[p.name];
  }

  /* A run takes its turn in the server's line (app/labs/queue.py): kv.follow streams its place, then its progress
     ("policy 4 of 9, step 7 of 16"), one line per change; Stop (or leaving the page, which closes the connection)
     ends it, as Stop ends the decode page's Run N. When it is done the result comes as the page's fragment (from
     the server's finished results: no second run) and is drawn. A new Run replaces the one in progress. */
  let current = null;  // the run this page follows: { controller, job }

  function line(text, fraction, running) {
    $("arena-line").hidden = false;
    $("arena-line-text").textContent = text;
    const bar = $("arena-line-bar");
    if (fraction === null) bar.removeAttribute("value"); else bar.value = fraction;
    $("arena-stop").hidden = !running;
  }

  function body(form) {
    const f = new FormData(form);
    return {
      model: f.get("model") || null, source: f.get("source") || "text", prompt: f.get("prompt") || null,
      steps: Number(f.get("steps")), budget_kind: f.get("budget_kind") || "percent", budget: Number(f.get("budget")),
      policies: f.getAll("policies"), go_on: f.get("go_on") === "true",
    };
  }

  async function run(form, push) {
    if (current) current.controller.abort();  // the server replaces this browser's earlier run anyway
    kv.clearError();
    const query = new URLSearchParams(new FormData(form)).toString();
    if (push) history.pushState(null, "", "/arena?" + query);  // the run is a link
    const me = { controller: new AbortController(), job: null };
    current = me;
    const last = await kv.followRun("/api/arena/jobs", body(form), me, { show: line, isCurrent: () => current === me, lineId: "arena-line" });
    if (current !== me) return;
    current = null;
    if (last && last.event === "done") {
      await htmx.ajax("GET", "/arena?" + query, { target: "#arena-result", swap: "innerHTML" });
    }
  }

  async function stop() {
    const me = current;
    if (!me) return;
    current = null;
    if (me.job) await kv.forget("/api/arena/jobs/" + encodeURIComponent(me.job));  // closing the connection is enough
    me.controller.abort();
    line(kv.t("js.lab.stopped"), null, false);
  }

  const form = $("arena-form");
  form.addEventListener("submit", (e) => { e.preventDefault(); run(form, true); });
  $("arena-stop").addEventListener("click", stop);
  page.view("arena-result", draw);
  if (form.dataset.autorun) run(form, false);  // a link to a run that has not finished yet: run it here
});
