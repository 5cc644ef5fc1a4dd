/* /engine: a real vLLM's KV cache, live. The server mirrors the engine's KV events and scrapes its /metrics; this
   script follows /api/engine/<i>/stream (one JSON snapshot a line, kv.follow) and draws the snapshot: status,
   counters, the blocks as a prefix tree (parent links), what just happened. Drive posts a preset to the engine
   through the server and shows KVScope's own pool beside the engine's events and counters. The fleet panel:
   which engine holds which prefix, and where a typed prompt would find the most cached blocks. */
window.kv.page("engine", (page) => {
  "use strict";
  const kv = window.kv, $ = kv.$, el = kv.el;
  const root = $("engine-root");
  if (!root) return;  // no engine configured: the page says how to start one
  const pick = $("engine-index");
  let index = pick ? +pick.value : 0, controller = null, lastVersion = -1, seen = new Set();
  const pct = (x) => (x === null || x === undefined ? "—" : (100 * x).toFixed(1) + " %");
  const short = (h) => (h ? h.slice(0, 8) : "—");
  /* A block's text as its characters (newlines and tabs escaped, no quotes): a chain's blocks side by side. */
  const raw = (text) => (text === null || text === undefined ? kv.t("engine.js.decoding") : JSON.stringify(text).slice(1, -1));
  const shown = (text) => (text === null || text === undefined ? kv.t("engine.js.decoding") : JSON.stringify(text));

  function drawStatus(snap) {
    $("engine-status").replaceChildren(...snap.status.map((s) => el("li", { class: "st-" + s.level }, s.text)));
  }

  /* The engine stopped answering: its last figures stay, marked as of when it last answered (counted on here). */
  let staleTimer = null;
  function drawStale(m) {
    clearInterval(staleTimer);
    const box = $("m-stale"), panel = $("engine-metrics-panel");
    const stale = m && m.stale_s !== null && m.stale_s !== undefined;
    box.hidden = !stale;
    panel.classList.toggle("stale", stale);
    if (!stale) return;
    const since = Date.now() - m.stale_s * 1000;
    const tick = () => { box.textContent = kv.t("engine.metrics.stale", { s: kv.int(Math.round((Date.now() - since) / 1000)) }); };
    tick();
    staleTimer = setInterval(tick, 1000);
  }

  function drawMetrics(m) {
    drawStale(m);
    if (!m) return;
    $("m-usage").textContent = pct(m.usage);
    $("m-hit").textContent = pct(m.hit_rate);
    $("m-hit-about").textContent = kv.t("engine.metrics.hit_rate.about", { recent: pct(m.hit_rate_recent) });
    $("m-running").textContent = `${m.running ?? "—"} / ${m.waiting ?? "—"}`;
    $("m-ttft").textContent = kv.ms(m.ttft_mean_s);
    $("m-ttft-about").textContent = kv.t("engine.metrics.mean", { n: m.ttft_count });
    $("m-itl").textContent = kv.ms(m.itl_mean_s);
    $("m-itl-about").textContent = kv.t("engine.metrics.mean", { n: m.itl_count });
    const c = m.config;
    if (c.block_size) {
      $("m-config").textContent = kv.t("engine.metrics.config", {
        blocks: kv.int(+c.num_gpu_blocks), size: c.block_size, tokens: kv.int(+c.kv_cache_size_tokens),
        bytes: kv.bytes(+c.kv_cache_memory_bytes), algo: c.prefix_caching_hash_algo ?? "—",
        caching: c.enable_prefix_caching ?? "—" });  // a label the engine does not export: a dash, not "null"
    }
  }

  /* The blocks as a forest: a block whose parent is not drawn (evicted, older than the shown ones, or none: the
     first block of a request) is a root. */
  function drawTree(snap) {
    const byHash = new Map(snap.blocks.map((b) => [b.group + ":" + b.medium + ":" + b.hash, b]));
    const kids = new Map(), roots = [];
    for (const b of snap.blocks) {
      const pk = b.group + ":" + b.medium + ":" + b.parent;
      if (b.parent && byHash.has(pk)) {
        if (!kids.has(pk)) kids.set(pk, []);
        kids.get(pk).push(b);
      } else roots.push(b);
    }
    const node = (b, depth) => {
      const key = b.group + ":" + b.medium + ":" + b.hash;
      const fresh = !seen.has(key) && lastVersion >= 0;
      const li = el("li", { class: fresh ? "blk new" : "blk", "data-hash": b.hash },
        el("div", { class: "blk-box" },
          el("code", { class: "blk-hash", title: b.hash }, short(b.hash)),
          el("span", { class: "blk-text" }, shown(b.text)),
          el("small", { class: "blk-meta" }, kv.t("engine.js.tokens", { n: b.tokens }), " · ",
            kv.t("engine.js.group", { g: b.group }), " · ", b.medium, " · ", kv.t("engine.js.seq", { seq: b.seq }))));
      const children = kids.get(key);
      if (children && depth < 64) li.append(el("ul", null, ...children.map((c) => node(c, depth + 1))));
      return li;
    };
    const tree = $("engine-tree");
    if (!snap.blocks.length) tree.replaceChildren(el("li", { class: "empty" }, kv.t("engine.js.blocks_none")));
    else tree.replaceChildren(...roots.map((b) => node(b, 0)));
    seen = new Set(snap.blocks.map((b) => b.group + ":" + b.medium + ":" + b.hash));
    const c = snap.counts;
    $("tree-counts").textContent = kv.t("engine.tree.counts", { held: kv.int(c.held), stored: kv.int(c.stored),
      removed: kv.int(c.removed), seq: c.next_seq ?? 0 }) +
      (c.held > c.shown ? " · " + kv.t("engine.js.more", { n: kv.int(c.held - c.shown) }) : "");
    $("tree-groups").replaceChildren(
      ...snap.groups.map((g) => el("li", null, kv.t("engine.tree.group", { group: g.group, kind: g.kind || "—",
        window: g.window ? kv.t("engine.js.window", { w: g.window }) : "", held: g.held }))),
      el("li", null, kv.t("engine.tree.media", { media: snap.media.join(", ") || "—" })));
  }

  function drawFeed(snap) {
    const words = (c) => {
      if (c.op === "stored") return kv.t("engine.js.stored", { hash: short(c.hash), seq: c.seq });
      if (c.op === "removed") return kv.t("engine.js.removed", { hash: short(c.hash) });
      if (c.op === "gap") return kv.t("engine.js.gap", { first: c.first, last: c.last });
      if (c.op === "restart") return kv.t("engine.js.restart");
      return kv.t("engine.js.cleared");
    };
    $("engine-feed").replaceChildren(...snap.changes.slice().reverse().map((c) => el("li", { class: "op-" + c.op }, words(c))));
  }

  function draw(snap) {
    drawStatus(snap);
    drawMetrics(snap.metrics);
    drawTree(snap);
    drawFeed(snap);
    lastVersion = snap.version;
  }

  async function drawCalculator() {
    const i = index;
    const c = await kv.getJSON(`/api/engine/${i}/calculator`).catch(() => null);
    if (i !== index) return;  // another engine was picked meanwhile: its own call draws
    const body = $("calc-table").querySelector("tbody");
    if (!c || !c.model) {
      $("calc-explain").textContent = kv.t("engine.calc.unknown");
      body.replaceChildren();
      return;
    }
    $("calc-explain").textContent = [kv.t("engine.calc.explain", { bytes: kv.bytes(c.kv_memory_bytes), size: c.block_size,
      context: kv.int(c.context), dtype: c.dtype, model: c.model }),
      c.groups > 1 ? kv.t("engine.calc.groups", { groups: c.groups, layers: c.group_size, block: kv.bytes(c.block_bytes) }) : "",
      c.windowed ? kv.t("engine.calc.windowed", { batched: kv.int(c.batched_tokens) }) : ""].filter(Boolean).join(" ");
    const row = (key, a, b) => el("tr", { class: a === b ? "same" : "differ" }, el("th", null, kv.t(key)),
      el("td", null, a), el("td", null, b));
    const conc = (x) => (x === null || x === undefined ? "—" : x.toFixed(2) + "×");
    body.replaceChildren(
      row("engine.calc.row.blocks", kv.int(c.ours.num_blocks), c.theirs.num_blocks === null ? "—" : kv.int(c.theirs.num_blocks)),
      row("engine.calc.row.tokens", kv.int(c.ours.tokens), c.theirs.tokens === null ? "—" : kv.int(c.theirs.tokens)),
      row("engine.calc.row.concurrency", conc(c.ours.max_concurrency), conc(c.theirs.max_concurrency)));
  }

  /* Follow engine `index`'s stream, one at a time: each call aborts the loop before it (an engine switch) and
     runs until its own controller is aborted; when its stream ends (its time is up, the server restarted) or
     breaks, it opens a new one. A loop reads only its own controller: the shared one is the newest loop's. */
  async function follow() {
    if (controller) controller.abort();
    const mine = new AbortController(), i = index;
    controller = mine;
    while (!mine.signal.aborted) {
      try {
        await kv.follow(`/api/engine/${i}/stream`, { since: -1 }, (snap) => { if (!mine.signal.aborted) draw(snap); },
          mine.signal);
      } catch (e) {
        if (mine.signal.aborted) return;
      }
      if (mine.signal.aborted) return;
      $("engine-status").append(el("li", { class: "st-info" }, kv.t("engine.js.reconnecting")));
      await new Promise((r) => setTimeout(r, 1500));
    }
  }

  function drawRun(run) {
    const box = $("drive-result");
    if (!run) return;
    const t = run.totals;
    const rows = run.rows.map((r) => el("tr", { class: r.same ? "same" : "differ" },
      el("td", null, kv.t("engine.js.request", { n: r.request }), " ", el("small", null, r.group_text)),
      el("td", null, `${r.tokens} (${r.blocks})`),
      el("td", null, `${r.ours.hit_tokens} / ${r.theirs.hit_tokens}`),
      el("td", null, `${r.ours.stored} / ${r.theirs.stored}`),
      el("td", null, `${r.ours.evicted} / ${r.theirs.evicted}`),
      el("td", null, r.same ? "✓" : "✗")));
    const head = el("tr", null, ...["request", "tokens", "hits", "stored", "evicted", "agree"].map((k) =>
      el("th", null, kv.t("engine.drive.col." + k) + (["hits", "stored", "evicted"].includes(k)
        ? ` (${kv.t("engine.js.ours")} / ${kv.t("engine.js.theirs")})` : ""))));
    box.replaceChildren(
      el("p", { class: run.same ? "verdict same" : "verdict differ" },
        run.same ? kv.t("engine.drive.same") : kv.t("engine.drive.differ", { why: run.first_difference.text })),
      el("div", { class: "table-scroll" }, el("table", { class: "engine-table", id: "drive-table" }, el("thead", null, head),
        el("tbody", null, ...rows))),
      el("p", { class: "explain" }, kv.t("engine.drive.totals", { ours: pct(t.ours.hit_rate), theirs: pct(t.theirs.hit_rate) })));
  }

  $("drive-buttons").addEventListener("click", async (e) => {
    const b = e.target.closest("button[data-preset]");
    if (!b) return;
    const buttons = [...$("drive-buttons").querySelectorAll("button")];
    buttons.forEach((x) => { x.disabled = true; });
    $("drive-result").replaceChildren();
    const run = await kv.act("POST", "/api/engine/drive", { engine: index, preset: b.dataset.preset }, "drive-busy");
    buttons.forEach((x) => { x.disabled = false; });
    drawRun(run);
  });

  /* Send and capture, watched: the two requests go to the engine shown (the first plain, the second flagged); while
     the engine serves the second, each forward step's rows appear on a small map as its workers capture them
     (POST /api/engine/<i>/served/follow, kv.follow), then the captured request opens on Inspect; a lesson in
     progress goes along (kv.visit). Without scripts the form posts and the page opens at the end. */
  function drawRows(ev) {
    const c = $("served-follow-canvas"), ctx = c.getContext("2d"), n = ev.expect, s = c.width / Math.max(n, 1);
    ctx.clearRect(0, 0, c.width, c.height);
    ctx.fillStyle = "#f1efe6";  // the positions no step has computed (yet)
    ctx.fillRect(0, 0, c.width, c.height);
    ev.steps.forEach(([a, rows], k) => {  // a step's rows: each attends to every key up to itself
      ctx.fillStyle = k === 0 ? "#6f9fd8" : k === ev.steps.length - 1 ? "#d08a00" : "#1f5fa8";
      for (let r = a; r < a + rows; r++) ctx.fillRect(0, r * s, (r + 1) * s, Math.max(s, 1));
    });
    if (ev.computed_from) {  // the keys read from cached blocks
      ctx.fillStyle = "rgba(107,114,128,0.45)";
      ctx.fillRect(0, 0, ev.computed_from * s, c.height);
    }
  }
  $("served-ask").addEventListener("submit", async (e) => {
    e.preventDefault();
    const f = e.target, send = $("served-send");
    send.disabled = true;
    kv.clearError();
    $("served-follow").hidden = false;
    const body = { before: f.before.value.trim() || null, prompt: f.prompt.value, max_tokens: +f.max_tokens.value || 1 };
    const last = await kv.follow("/api/engine/" + index + "/served/follow", body, (ev) => {
      $("served-follow-text").textContent = ev.text || "";
      if (ev.steps) drawRows(ev.event === "done" ? { ...ev, expect: ev.steps.at(-1)[0] + ev.steps.at(-1)[1] } : ev);
    }).catch(() => null);
    send.disabled = false;
    if (last && last.event === "done") kv.visit(last.result.page);
    else if (last && last.event === "failed") kv.showError(last.text);
  });

  /* The fleet: every engine's index as chains of blocks, merged (GET /api/engine/fleet), refreshed every few
     seconds while the page is in view; a typed prompt scored on each engine (POST /api/engine/route). */
  async function drawFleet() {
    const f = await kv.getJSON("/api/engine/fleet").catch(() => null);
    if (!f) return;
    $("fleet-engines").replaceChildren(...f.engines.map((e) => el("li", { class: e.reproducible === false ? "st-warn" : "" },
      e.reproducible === false ? kv.t("engine.fleet.unreproducible", { index: e.index })
        : kv.t("engine.fleet.engine", { index: e.index, held: kv.int(e.held), size: e.block_size ?? "—",
          algo: e.hash_algo ?? "—", usage: pct(e.usage) }))));
    const body = $("fleet-table").querySelector("tbody");
    if (!f.chains.length) {
      body.replaceChildren(el("tr", null, el("td", { colspan: 2 + f.engines.length }, kv.t("engine.fleet.none"))));
    } else {
      body.replaceChildren(...f.chains.map((c) => el("tr", null,
        el("td", { class: "fleet-text" }, c.from_start ? "" : el("small", null, kv.t("engine.fleet.mid"), " "),
          ...c.texts.map((t, j) => el("span", { class: "fleet-blk", title: j === 0 ? c.first : "" }, raw(t)))),
        el("td", null, `${c.blocks} (${kv.int(c.tokens)})`),
        ...c.held.map((n) => el("td", { class: n ? (n === c.blocks ? "held all" : "held") : "" }, n ? `${n} / ${c.blocks}` : "—")))));
    }
    $("fleet-more").textContent = f.total > f.chains.length ? kv.t("engine.fleet.more", { n: f.total - f.chains.length }) : "";
  }

  $("fleet-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const r = await kv.act("POST", "/api/engine/route", { prompt: $("fleet-prompt").value }, "fleet-busy");
    if (!r) return;
    $("fleet-verdict").textContent = r.verdict;
    const table = $("route-table");
    table.hidden = false;
    table.querySelector("tbody").replaceChildren(...r.rows.map((x) => el("tr", { class: x.index === r.pick ? "best" : "" },
      el("td", null, `${x.index} · `, el("code", null, x.url)),
      ...(x.error ? [el("td", { colspan: 5 }, x.error)]
        : [el("td", null, `${x.tokens} (${x.blocks})`), el("td", null, `${x.matched} / ${x.blocks}`),
          el("td", null, kv.int(x.matched_tokens)), el("td", null, kv.int(x.hit_tokens)), el("td", null, pct(x.usage))]))));
    drawFleet();
  });

  if (pick) pick.addEventListener("change", () => {
    index = +pick.value;
    lastVersion = -1;
    drawCalculator();
    follow();
  });
  const last = $("last-run");
  if (last) drawRun(JSON.parse(last.textContent));
  drawCalculator();
  drawFleet();
  setInterval(() => { if (document.visibilityState === "visible") drawFleet(); }, 3000);
  follow();
});
