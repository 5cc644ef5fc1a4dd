// /capacity: the KV memory calculator, the scheduler simulator and the engine check. JSON in, DOM and Plotly out.
// User text only via textContent; every sentence comes from the catalog through kv.t().
window.kv.page("capacity", () => {
  "use strict";
  const kv = window.kv, $ = kv.$, t = kv.t;
  const GiB = 1024 ** 3;
  const bytes = (n) => kv.bytes(n, true);  // two decimals: the figures are read beside vLLM's log
  const int = kv.int, ms = kv.ms;
  const num = (v) => (v === "" || v === null ? null : Number(v));

  // --- calculator ------------------------------------------------------------------------------------
  function modelChoice(selectId) {
    const model = $(selectId).value;
    const body = { model };
    if (model === "config") body.config_json = $("config-json").value;
    if (model === "custom") {
      body.custom = {};
      ["n_layer", "n_head", "n_kv_head", "head_dim", "kv_lora_rank", "qk_rope_head_dim"].forEach((k) => {
        const v = num($("c-" + k).value);
        if (v !== null) body.custom[k] = v;
      });
      if (!body.custom.kv_lora_rank) { delete body.custom.kv_lora_rank; delete body.custom.qk_rope_head_dim; }
    }
    return body;
  }

  function calcBody() {
    const body = modelChoice("calc-model");
    Object.assign(body, {
      attention: $("calc-attention").value || null, dtype: $("calc-dtype").value, scales: $("calc-scales").value,
      block_size: Number($("calc-block").value), tp: Number($("calc-tp").value), batch: num($("calc-batch").value),
      context: num($("calc-context").value), gpu_memory_gib: num($("calc-gpu-mem").value),
      utilization: num($("calc-util").value), weight_dtype: $("calc-wdtype").value,
      weight_gib: num($("calc-weight").value), other_gib: num($("calc-other").value) || 0,
      kv_memory_gib: num($("calc-kvmem").value),
    });
    return body;
  }

  function showModelBoxes() {
    const m = $("calc-model").value;
    $("config-box").hidden = m !== "config";
    $("custom-box").hidden = m !== "custom";
  }

  async function runCalc() {
    linkCalc();
    const key = $("calc-model").value;
    const r = await kv.act("POST", "/api/capacity/calculate", calcBody(), "calc-busy");
    if (r) {
      drawCalc(r);
      $("calc-result").dataset.model = key;  // which model the figures are for (the lesson waits on it)
    }
  }

  /* The calculator's inputs are in the URL (?calc-batch=64&calc-gpu=h100-80gb…, only those changed from the
     page's defaults), so a link or a reload opens the same figures. A pasted config stays out (too long). */
  const LINKED = [...$("calc-form").querySelectorAll("select[id], input[id]")].filter((e) => e.type !== "file");
  const defaultOf = (e) => (e.tagName === "SELECT"
    ? ([...e.options].find((o) => o.defaultSelected) || e.options[0] || { value: "" }).value : e.defaultValue);
  function linkCalc() {
    kv.setQuery(Object.fromEntries(LINKED.map((e) => [e.id, e.value === defaultOf(e) ? null : e.value])));
  }
  function readLink() {
    const q = new URLSearchParams(window.location.search);
    LINKED.forEach((e) => {
      const v = q.get(e.id);
      if (v !== null && (e.tagName !== "SELECT" || [...e.options].some((o) => o.value === v))) e.value = v;
    });
  }

  function drawCalc(r) {
    $("calc-result").hidden = false;
    const m = r.model, inp = r.input;
    $("model-facts").textContent = t("js.capacity.facts", {
      layers: m.n_layer, heads: m.n_head, kv: m.kv_lora_rank ? "—" : m.n_kv_head, dim: m.head_dim,
      kind: r.attention, params: (m.parameters / 1e9).toFixed(m.parameters < 1e9 ? 3 : 2),
    }) + (m.note ? " " + t("js." + m.note) : "");
    $("r-formula").textContent = r.formula.split(" = ")[0];
    $("r-per-token").textContent = bytes(r.bytes_per_token);
    $("r-tp").textContent = inp.tp > 1
      ? t(r.kv_heads_per_gpu === null ? "js.capacity.tp_mla" : (r.replicated ? "js.capacity.tp_replicated" : "js.capacity.tp_split"),
        { tp: inp.tp, heads: r.kv_heads_per_gpu, total: bytes(r.bytes_per_token_all_gpus) })
      : "";
    $("r-page").textContent = `${inp.block_size} × ${bytes(r.bytes_per_token)} = ${bytes(r.page_bytes)}`;
    $("r-request").textContent = t(r.windowed ? "js.capacity.request_layers" : "js.capacity.request", {
      ctx: int(inp.context), blocks: int(r.blocks_per_request), bytes: bytes(r.request_bytes), waste: r.tail_waste_tokens,
    });
    // Sliding-window layers hold at most their window: the request's bytes, layer kind by layer kind.
    $("r-layers").hidden = !r.windowed;
    $("r-layers").replaceChildren(...(r.windowed ? r.layer_kinds : []).map((k) => kv.el("li", null, t(
      k.window === null ? "js.capacity.layers_full" : "js.capacity.layers_sliding",
      { n: k.n_layers, window: k.window, held: int(k.tokens_held), blocks: int(k.blocks), per: bytes(k.bytes_per_token),
        bytes: bytes(k.block_bytes) }))));
    $("r-batch").textContent = `${int(inp.batch)} × ${bytes(r.request_bytes)} = ${bytes(r.batch_bytes)}`;
    $("r-weights").textContent = r.weights_known
      ? t("js.capacity.weights", {
        params: (r.parameters / 1e9).toFixed(2), bytes: bytes(r.weight_bytes), per_gpu: bytes(r.weights_per_gpu),
      })
      : t("js.capacity.weights_unknown");
    const memory = { gpu: inp.gpu_memory_gib, util: inp.utilization, weights: bytes(r.weights_per_gpu),
      other: bytes(inp.other_gib * GiB) };
    $("r-kv").textContent = inp.kv_memory_gib !== null
      ? t("js.capacity.kv_given", { kv: bytes(r.kv_memory) })
      : t(r.weights_fit ? "js.capacity.kv_memory" : "js.capacity.kv_no_room",
        Object.assign({ kv: bytes(r.kv_memory), short: bytes(r.kv_shortfall) }, memory));
    // Each figure with its unit, from the catalog: "1,671,880 tokens / 64 tokens a request = 26,123.13 requests".
    const figs = { kv: bytes(r.kv_memory), page: bytes(r.page_bytes), blocks: int(r.all_layer_blocks), size: int(inp.block_size),
      tokens: int(r.tokens), ctx: int(inp.context), need: bytes(r.request_bytes), conc: kv.dec(r.max_concurrency, 2) };
    $("r-blocks").textContent = t("js.capacity.r.blocks", figs);
    $("r-tokens").textContent = t("js.capacity.r.tokens", figs);
    $("r-conc").textContent = t(r.windowed ? "js.capacity.r.conc_bytes" : "js.capacity.r.conc", figs);
    // vLLM refuses to start when not one request of max_model_len fits: say that, never a negative size.
    const needed = { ctx: int(inp.context), need: bytes(r.request_bytes), kv: bytes(r.kv_memory) };
    $("r-vllm").textContent = !r.weights_fit ? t("js.capacity.vllm_no_memory")
      : r.whole_requests < 1 ? t("js.capacity.vllm_too_long", needed)
        : t("js.capacity.vllm_line", {
          kv: (r.kv_memory / GiB).toFixed(2), blocks: r.num_blocks, ctx: inp.context, conc: r.max_concurrency.toFixed(2),
        });
    drawTpFit(r, memory, needed);
    const fits = $("r-fits");
    fits.className = r.batch_fits ? "ok" : "bad";
    fits.textContent = t(r.batch_fits ? "js.capacity.fits" : "js.capacity.no_fit", {
      n: inp.batch, batch: int(inp.batch), ctx: int(inp.context), whole: int(r.whole_requests),
    });
    $("r-paged").hidden = !r.paged_link;
    if (r.paged_link) $("r-paged-link").href = r.paged_link;
    $("variants").tBodies[0].replaceChildren(...r.chart.variants.map((v) => {
      const tr = kv.el("tr", { class: v.kind === r.attention ? "pick" : null, "data-kind": v.kind });
      [v.kind, v.kv_heads === null ? "—" : v.kv_heads, bytes(v.bytes_per_token), bytes(v.request_bytes)]
        .forEach((x, i) => tr.append(kv.el("td", { class: i ? null : "l" }, x)));
      return tr;
    }));
    drawCalcChart(r);
  }

  // Not one request fits at this TP: why (the weights, or the request), and the smallest TP that fits, if any.
  function drawTpFit(r, memory, needed) {
    $("r-tp-fit").hidden = !r.tp_searched;
    if (!r.tp_searched) return;
    $("r-tp-fit-why").textContent = r.weights_fit ? t("js.capacity.request_too_big", needed)
      : t(r.input.other_gib ? "js.capacity.weights_too_big" : "js.capacity.weights_too_big_alone",
        Object.assign({ budget: bytes(r.gpu_budget) }, memory));
    const fit = r.tp_fit, use = $("r-tp-use");
    $("r-tp-fit-how").textContent = fit
      ? t("js.capacity.tp_fit", { tp: fit.tp, weights: bytes(fit.weights_per_gpu), kv: bytes(fit.kv_memory),
        whole: int(fit.whole_requests), ctx: int(r.input.context) })
      : t("js.capacity.tp_none", { ctx: int(r.input.context) });
    use.hidden = !fit;
    if (fit) {
      use.textContent = t("js.capacity.tp_use", { tp: fit.tp });
      use.dataset.tp = fit.tp;
    }
  }
  $("r-tp-use").addEventListener("click", () => { $("calc-tp").value = $("r-tp-use").dataset.tp; runCalc(); });

  async function drawCalcChart(r) {
    const Plotly = await kv.plotly();
    const xs = r.chart.contexts;
    const traces = r.chart.variants.map((v) => ({
      x: xs, y: v.batch_bytes.map((b) => b / GiB), name: `${v.kind}${v.kv_heads ? " (" + v.kv_heads + ")" : ""}`,
      mode: "lines+markers", line: { width: v.kind === r.attention ? 4 : 2, dash: v.kind === r.attention ? "solid" : "dot" },
      hovertemplate: "%{x:,} tokens: %{y:.2f} GiB<extra>%{fullData.name}</extra>",
    }));
    if (r.input.tp > 1) {  // the variants are on one GPU (r.chart.tp), in the chosen dtype already
      traces.push({ x: xs, y: r.chart.batch_bytes.map((b) => b / GiB), name: t("js.capacity.chart.chosen"),
        mode: "lines", line: { width: 4, color: "#16213a" } });
    }
    if (r.kv_memory > 0) {  // a log axis has no 0: without KV memory there is no line to draw
      traces.push({ x: [xs[0], xs[xs.length - 1]], y: [r.kv_memory / GiB, r.kv_memory / GiB], mode: "lines",
        name: t("js.capacity.chart.budget"), line: { color: "#a4001d", dash: "dash" } });
    }
    Plotly.react("calc-chart", traces, {
      title: { text: t("js.capacity.chart.title", { n: r.input.batch, batch: int(r.input.batch), dtype: r.chart.dtype, tp: r.chart.tp }), font: { size: 16 } },
      xaxis: { title: { text: t("js.capacity.chart.context") }, type: "log" },
      yaxis: { title: { text: "GiB" }, type: "log" }, margin: { l: 60, r: 10, t: 40, b: 50 },
      font: kv.plotFont, height: 380, legend: { orientation: "h", y: -0.25 },
    }, kv.PLOT_CONFIG);
  }

  const PRESETS = {
    article: { "calc-model": "llama-3-8b", "calc-attention": "", "calc-dtype": "bf16", "calc-block": "16", "calc-tp": "1",
      "calc-batch": 32, "calc-context": 8192, "calc-gpu": "a100-80gb", "calc-gpu-mem": 80, "calc-util": 0.9, "calc-kvmem": "", "calc-other": 0, "calc-weight": "" },
    vllm: { "calc-model": "llama-3-8b", "calc-attention": "", "calc-dtype": "bf16", "calc-block": "16", "calc-tp": "1",
      "calc-batch": 1, "calc-context": 8192, "calc-gpu": "a100-40gb", "calc-gpu-mem": 40, "calc-util": 0.9, "calc-kvmem": 11.116, "calc-other": 0, "calc-weight": "" },
  };
  document.querySelectorAll("[data-preset]").forEach((b) => b.addEventListener("click", () => {
    const name = b.dataset.preset;
    const values = name === "loaded"
      ? { "calc-model": "loaded:" + $("calc").dataset.loadedModel, "calc-attention": "", "calc-dtype": "fp32", "calc-block": "4",
        "calc-tp": "1", "calc-batch": 1, "calc-context": 64, "calc-kvmem": "", "calc-weight": "" }
      : PRESETS[name];
    Object.entries(values).forEach(([id, v]) => { $(id).value = v; });
    showModelBoxes();
    runCalc();
  }));
  $("calc-model").addEventListener("change", showModelBoxes);
  $("calc-gpu").addEventListener("change", () => { $("calc-gpu-mem").value = $("calc-gpu").selectedOptions[0].dataset.mem; });
  $("config-file").addEventListener("change", () => {
    const f = $("config-file").files[0];
    if (!f) return;
    if (f.size > 60000) { kv.showError(t("js.capacity.file_too_big")); return; }
    f.text().then((text) => { $("config-json").value = text; });
  });
  $("calc-form").addEventListener("submit", (e) => { e.preventDefault(); runCalc(); });
  $("calc-form").addEventListener("change", (e) => { if (e.target.type !== "file" && e.target.id !== "config-json") runCalc(); });

  /* A step's events in words: "admitted 3, 4 · finished 1" (the simulator's timeline and the engine check). */
  const events = (x) => ["admitted", "preempted", "finished"].filter((k) => x[k].length)
    .map((k) => t("js.capacity.ev." + k, { ids: x[k].join(", ") }));

  // --- simulator --------------------------------------------------------------------------------------
  function simBody() {
    const body = { model: $("sim-model").value, cost: $("sim-cost").value, gpu: $("sim-gpu").value,
      tp: Number($("sim-tp").value), dtype: $("sim-dtype").value, block_size: Number($("sim-block").value), num_blocks: num($("sim-blocks").value),
      max_num_batched_tokens: num($("sim-budget").value), max_num_seqs: num($("sim-seqs").value),
      chunked_prefill: $("sim-chunked").checked, prefix_caching: $("sim-prefix").checked,
      workload: document.querySelector("input[name=workload]:checked").value };
    if (body.workload === "list") body.requests_text = $("sim-list").value;
    else Object.assign(body, { n: num($("sim-n").value), rate: num($("sim-rate").value), prompt_min: num($("sim-pmin").value),
      prompt_max: num($("sim-pmax").value), output_min: num($("sim-omin").value), output_max: num($("sim-omax").value),
      shared_prefix_fraction: num($("sim-share").value), prefix_len: num($("sim-plen").value), seed: num($("sim-seed").value) });
    return body;
  }
  document.querySelectorAll("input[name=workload]").forEach((r) => r.addEventListener("change", () => {
    const list = document.querySelector("input[name=workload]:checked").value === "list";
    $("list-box").hidden = !list; $("synthetic-box").hidden = list;
  }));
  $("sim-cost").addEventListener("change", () => {
    if ($("sim-cost").value === "measured" && !$("sim-model").value.startsWith("loaded:")) {
      const loaded = [...$("sim-model").options].find((o) => o.value.startsWith("loaded:"));
      if (loaded) $("sim-model").value = loaded.value;
      if (!$("sim-blocks").value) $("sim-blocks").value = 512;
    }
  });
  $("sim-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const r = await kv.act("POST", "/api/capacity/simulate", simBody(), "sim-busy");
    if (r) drawSim(r);
  });

  function drawSim(r) {
    $("sim-result").hidden = false;
    const c = r.counters, cost = r.cost, stop = r.stopped;
    $("sim-stopped").hidden = !stop;
    if (stop) {
      $("sim-stopped").textContent = t("js.capacity.sim.stopped." + stop.reason, {
        limit: stop.reason === "steps" ? int(stop.limit) : stop.limit, steps: int(stop.steps), simulated: c.makespan_s.toFixed(2),
        finished: int(stop.finished), requests: int(stop.requests),
      });
    }
    $("sim-limit").textContent = cost.kind === "roofline"
      ? t("js.capacity.sim.roofline", { gpu: cost.gpu, weights: bytes(cost.weight_bytes), bw: (cost.bandwidth / 1e12).toFixed(2),
        floor: ms(cost.min_step_s), tps: cost.max_tokens_per_s_per_seq.toFixed(0), ridge: cost.ridge_batch ? cost.ridge_batch.toFixed(0) : "—" })
      : t("js.capacity.sim.measured", { model: cost.model, a: ms(cost.per_sequence_s), b: ms(cost.per_token_s),
        tps: cost.max_tokens_per_s_per_seq.toFixed(1) });
    const items = [
      ["num_requests", int(c.num_requests)], [t("js.capacity.sim.finished"), int(c.finished_requests)],
      ["num_steps", int(c.num_steps)],
      ["num_preemptions", int(c.num_preemptions)],
      ["prefix_cache_hits / prefix_cache_queries", `${int(c.prefix_cache_hits)} / ${int(c.prefix_cache_queries)}` +
        (c.prefix_cache_hit_rate !== null ? ` (${(100 * c.prefix_cache_hit_rate).toFixed(1)}%)` : "")],
      ["kv_cache_usage_perc (" + t("js.capacity.sim.peak") + ")", (100 * c.peak_kv_cache_usage_perc).toFixed(1) + "%"],
      [t("js.capacity.sim.blocks"), int(r.config.num_blocks) + " × " + r.config.block_size],
      [t("js.capacity.sim.throughput"), `${c.output_tokens_per_s.toFixed(1)} tok/s · ${c.requests_per_s.toFixed(2)} req/s`],
      [t(stop ? "js.capacity.sim.simulated" : "js.capacity.sim.makespan"), c.makespan_s.toFixed(2) + " s"],
      [t("js.capacity.sim.max_waiting"), int(c.max_waiting)],
    ];
    $("sim-counters").replaceChildren(...items.map(([k, v]) => {
      return kv.el("div", null, kv.el("dt", null, k), kv.el("dd", null, v));
    }));
    const names = { ttft: "TTFT", tpot: "TPOT", e2e: t("js.capacity.sim.e2e") };
    $("sim-latency-table").tBodies[0].replaceChildren(...Object.entries(r.latency).map(([k, v]) => {
      return kv.el("tr", null, kv.el("td", { class: "l" }, names[k]),
        ...["p50", "p90", "p99", "mean"].map((p) => kv.el("td", null, ms(v.stats[p]))));
    }));
    $("sim-timeline").tBodies[0].replaceChildren(...r.timeline.map((s) => {
      const tr = kv.el("tr", { class: s.preempted.length ? "preempt" : null });
      [s.step, s.start.toFixed(3), s.prefill, s.decode, s.running, s.waiting, s.blocks_used].forEach((x) => tr.append(kv.el("td", null, x)));
      tr.append(kv.el("td", { class: "l" }, events(s).join(" · ")));
      const sched = s.scheduled.slice(0, 12).map(([id, n]) => `${id}:${n}`).join(" ") + (s.scheduled.length > 12 ? " …" : "");
      tr.append(kv.el("td", { class: "l mono" }, sched));
      return tr;
    }));
    drawSimCharts(r);
  }

  async function drawSimCharts(r) {
    const Plotly = await kv.plotly();
    const s = r.series, cfg = kv.PLOT_CONFIG;
    const base = { font: kv.plotFont, height: 320, margin: { l: 55, r: 55, t: 40, b: 45 }, legend: { orientation: "h", y: -0.3 } };
    Plotly.react("sim-usage", [
      { x: s.time, y: s.kv_cache_usage_perc.map((v) => 100 * v), name: "kv_cache_usage_perc (%)", mode: "lines" },
      { x: s.time, y: s.running, name: t("js.capacity.sim.running"), mode: "lines", yaxis: "y2" },
      { x: s.time, y: s.waiting, name: t("js.capacity.sim.waiting"), mode: "lines", yaxis: "y2" },
    ], Object.assign({}, base, { title: { text: t("js.capacity.sim.usage_title"), font: { size: 15 } },
      xaxis: { title: { text: t("js.capacity.sim.time") } }, yaxis: { title: { text: "%" }, range: [0, 100] },
      yaxis2: { overlaying: "y", side: "right", rangemode: "tozero", title: { text: t("js.capacity.sim.requests") } } }), cfg);
    Plotly.react("sim-tokens", [
      { x: s.step, y: s.prefill_tokens, name: t("js.capacity.sim.prefill"), type: "bar" },
      { x: s.step, y: s.decode_tokens, name: t("js.capacity.sim.decode"), type: "bar" },
    ], Object.assign({}, base, { barmode: "stack", title: { text: t("js.capacity.sim.tokens_title", { stride: s.stride }), font: { size: 15 } },
      xaxis: { title: { text: t("js.capacity.sim.step") } }, yaxis: { title: { text: t("js.capacity.sim.tokens") } } }), cfg);
    const lat = ["ttft", "tpot", "e2e"].map((k, i) => {
      const h = r.latency[k].hist;
      return { x: h.edges.slice(0, -1).map((e, j) => 1000 * (e + h.edges[j + 1]) / 2), y: h.counts, type: "bar",
        name: { ttft: "TTFT", tpot: "TPOT", e2e: t("js.capacity.sim.e2e") }[k], xaxis: "x" + (i ? i + 1 : ""), yaxis: "y" + (i ? i + 1 : "") };
    });
    Plotly.react("sim-latency", lat, Object.assign({}, base, { showlegend: false, grid: { rows: 1, columns: 3, pattern: "independent" },
      title: { text: t("js.capacity.sim.latency_title"), font: { size: 15 } },
      xaxis: { title: { text: "TTFT (ms)" } }, xaxis2: { title: { text: "TPOT (ms)" } },
      xaxis3: { title: { text: t("js.capacity.sim.e2e") + " (ms)" } }, yaxis: { title: { text: t("js.capacity.sim.count") } } }), cfg);
  }

  // --- engine check -----------------------------------------------------------------------------------
  $("check-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const r = await kv.act("POST", "/api/capacity/check", {
      model: $("check-model").value, num_blocks: num($("check-blocks").value), block_size: Number($("check-block").value),
      max_num_seqs: num($("check-seqs").value), requests_text: $("check-list").value,
    }, "check-busy");
    if (!r) return;
    $("check-result").hidden = false;
    const v = $("check-verdict");
    v.className = r.equal ? "ok" : "bad";
    v.textContent = r.equal
      ? t("js.capacity.check.equal", { steps: r.rows.length, preemptions: r.preemptions, model: r.model })
      : t("js.capacity.check.differ", { step: r.first_difference });
    const side = (x) => {
      if (!x) return "—";
      const parts = events(x);
      parts.push(t("js.capacity.ev.blocks", { used: x.blocks_used, running: x.running, waiting: x.waiting }));
      return parts.join(" · ");
    };
    $("check-table").tBodies[0].replaceChildren(...r.rows.map((row) => {
      return kv.el("tr", { class: row.same ? null : "differ" }, kv.el("td", null, row.step),
        kv.el("td", { class: "l" }, side(row.simulator)), kv.el("td", { class: "l" }, side(row.engine)),
        kv.el("td", { class: row.same ? "ok" : "bad" }, row.same ? "✓" : "✗"));
    }));
  });

  readLink();
  showModelBoxes();
  runCalc();
});
