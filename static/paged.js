// /paged: drives a server-side block pool through /api/paged/... and draws it. User text only via textContent.
(function () {
  "use strict";
  const PALETTE = ["#7fb3ff", "#ffb370", "#8fd694", "#f28fb1", "#c6a4ff", "#ffe071", "#6fd3d3", "#d7b48f"];
  const $ = (id) => document.getElementById(id);
  const lab = $("paged-lab");
  if (!lab) return;
  const labels = {};
  $("paged-labels").content.querySelectorAll("[data-k]").forEach((n) => { labels[n.dataset.k] = n.textContent; });
  let sid = null, timer = null, busy = false, last = null;

  const color = (seq) => PALETTE[seq % PALETTE.length];
  function el(tag, cls, text) {
    const n = document.createElement(tag);
    if (cls) n.className = cls;
    if (text !== undefined && text !== null) n.textContent = String(text);
    return n;
  }
  function fmtBytes(n) {
    const units = ["B", "KiB", "MiB", "GiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i === 0 ? n.toFixed(0) : n.toFixed(1)) + " " + units[i];
  }
  const showError = (msg) => window.kv.showError(msg);
  const t = (key, vars) => window.kv.t(key, vars);

  async function call(method, url, body) {
    if (busy) return null;
    busy = true;
    $("paged-busy").style.display = "inline";
    try {
      const r = await fetch(url, {
        method, headers: body ? { "Content-Type": "application/json" } : {},
        body: body ? JSON.stringify(body) : undefined,
      });
      const data = await r.json().catch(() => ({ detail: t("js.error.unreadable") }));
      if (!r.ok) { showError(data.detail || t("js.error.request_failed", { status: r.status })); stopPlay(); return null; }
      $("error").replaceChildren();
      render(data);
      return data;
    } catch (e) {
      showError(t("js.error.unreachable")); stopPlay(); return null;
    } finally {
      busy = false;
      $("paged-busy").style.display = "";
    }
  }

  function newPool() {
    stopPlay();
    const model = $("pool-model") ? $("pool-model").value : lab.dataset.model;
    return call("POST", "/api/paged/sessions", {
      model, num_blocks: Number($("pool-blocks").value), block_size: Number($("pool-block-size").value),
    }).then((d) => { if (d) sid = d.session; return d; });
  }
  const act = (path) => sid && call("POST", `/api/paged/sessions/${sid}${path}`);

  // --- drawing -------------------------------------------------------------------------------------
  function drawPool(view) {
    const pool = view.pool, before = last ? last.pool.blocks : null;
    $("pool-shape").textContent = `${pool.num_blocks} × ${pool.block_size} slots · ${fmtBytes(pool.bytes_total)}`;
    const boxes = pool.blocks.map((b, i) => {
      const box = el("div", "blk");
      box.dataset.block = b.id;
      box.dataset.ref = b.ref_cnt;
      const head = el("div");
      head.append(el("span", "bid", "#" + b.id));
      if (b.ref_cnt === 0) {
        box.classList.add("free");
        head.append(el("span", "owner", "free" + (b.free_pos !== null ? " · q" + b.free_pos : "")));
      } else {
        box.style.background = color(b.owners[0]);
        box.style.borderColor = b.owners.length > 1 ? "" : color(b.owners[0]);
        head.append(el("span", "owner", "seq " + b.owners.join(", ")));
        if (b.ref_cnt > 1) { box.classList.add("shared"); box.append(el("span", "ref", "×" + b.ref_cnt)); }
      }
      box.append(head);
      const slots = el("div", "slots");
      for (let s = 0; s < pool.block_size; s++) {
        const slot = el("span", "slot", s < b.slots.length ? b.slots[s] : "");
        if (b.ref_cnt > 0 && s >= b.filled) { slot.classList.add("waste"); slot.title = "tail waste"; }
        slots.append(slot);
      }
      box.append(slots);
      box.title = b.ref_cnt ? `block ${b.id}: ref_cnt ${b.ref_cnt}, ${b.filled}/${pool.block_size} slots written` : `block ${b.id}: free`;
      if (before && before[i] && (before[i].filled !== b.filled || before[i].ref_cnt !== b.ref_cnt
          || before[i].owners.join() !== b.owners.join())) box.classList.add("flash");
      return box;
    });
    $("pool-map").replaceChildren(...boxes);
    const sum = {
      step: view.step, used: pool.used, free: pool.free, tokens: view.summary.tokens_stored,
      slots: view.summary.slots_reserved, waste: view.summary.tail_waste, cow: pool.cow_copies,
      block_bytes: fmtBytes(pool.bytes_per_block),
    };
    $("pool-summary").querySelectorAll("dd").forEach((dd) => { dd.textContent = sum[dd.dataset.k]; });
  }

  function drawSequences(view) {
    const rows = view.sequences.slice().reverse().map((s) => {
      const tr = el("tr", s.status);
      tr.dataset.seq = s.id;
      const idCell = el("td");
      const sw = el("span", "swatch"); sw.style.background = color(s.id);
      idCell.append(sw, document.createTextNode(s.id + (s.parent !== null ? ` ← ${s.parent}` : "")));
      const st = el("td", "l"); st.append(el("span", "status " + s.status, s.status));
      if (s.preemptions) st.append(el("div", "explain", `preempted ×${s.preemptions}, recomputed ${s.recomputed_tokens}`));
      const txt = el("td", "l txt");
      txt.append(el("span", null, s.prompt), el("span", "gen", s.generated_text));
      if (s.next !== null && (s.status === "running" || s.status === "waiting")) txt.append(el("span", "next", s.next));
      const bt = el("td", "l");
      s.block_table.forEach((b, j) => {
        const chip = el("span", "bt"); chip.append(el("small", null, j + "→"), document.createTextNode(b));
        chip.style.borderColor = color(s.id); bt.append(chip);
      });
      const waste = el("td", null, s.block_table.length ? s.tail_waste : "");
      const acts = el("td", "l");
      if (s.status === "running" || s.status === "waiting") {
        const add = (k, enabled) => {
          const b = el("button", "secondary", labels[k]); b.type = "button"; b.dataset.action = k; b.disabled = !enabled;
          b.addEventListener("click", () => act(`/sequences/${s.id}/${k}`)); acts.append(b);
        };
        add("fork", s.can_fork); add("finish", true); add("cancel", true); add("preempt", s.status === "running");
      }
      tr.append(idCell, st, txt, bt, waste, acts);
      return tr;
    });
    $("seq-table").tBodies[0].replaceChildren(...rows);
    $("seq-empty").hidden = rows.length > 0;
    $("events").replaceChildren(...view.events.slice().reverse().map((e) => el("li", null, e)));
  }

  function drawStall(view) {
    const st = view.stall;
    $("stall").hidden = !st;
    if (!st) return;
    $("stall-what").textContent = st.kind === "admit"
      ? `seq ${st.seq_id} waits to be admitted: it needs ${st.needed} block(s), ${st.free} free.`
      : `seq ${st.blocked.join(", ")} cannot write its next token: ${st.needed} block needed, ${st.free} free.`;
    const running = view.sequences.filter((s) => s.status === "running");
    $("preempt-buttons").replaceChildren(...running.slice().reverse().map((s) => {
      const b = el("button", "secondary", labels.preempt_seq.replace("{id}", s.id));
      b.type = "button"; b.dataset.preempt = s.id;
      b.addEventListener("click", () => act(`/sequences/${s.id}/preempt`));
      return b;
    }));
    const blocked = st.blocked || [];
    $("stall-deadlock").hidden = !(st.kind === "grow" && running.length > 0 && blocked.length === running.length);
  }

  function drawCapacity(view) {
    const cap = view.capacity;
    $("cap-per-token").textContent = fmtBytes(cap.bytes_per_token);
    $("cap-budget").textContent = fmtBytes(cap.budget_bytes);
    $("cap-blocks").tBodies[0].replaceChildren(...cap.by_block_size.map((r) => {
      const tr = el("tr", r.block_size === view.pool.block_size ? "pick" : null);
      tr.dataset.bs = r.block_size;
      [r.block_size, fmtBytes(r.block_bytes), r.num_blocks, r.tokens.toLocaleString("en"), r.blocks_needed,
       r.waste_slots, r.waste_pct.toFixed(1)].forEach((v) => tr.append(el("td", null, v)));
      return tr;
    }));
    $("cap-formats").tBodies[0].replaceChildren(...cap.by_format.map((r) => {
      const tr = el("tr");
      tr.append(el("td", "l", r.name), el("td", null, r.bytes_per_token.toLocaleString("en")),
                el("td", null, r.tokens.toLocaleString("en")));
      return tr;
    }));
  }

  function render(view) {
    if (!view || !view.pool) return;
    drawPool(view); drawSequences(view); drawStall(view); drawCapacity(view);
    last = view;
  }

  // --- auto-play ---------------------------------------------------------------------------------------
  function stopPlay() {
    if (timer) clearInterval(timer);
    timer = null;
    $("play").textContent = $("play").dataset.play;
  }
  async function tick() {
    if (busy) return;
    const v = await act("/step");
    const live = v && v.sequences.some((s) => s.status === "running" || s.status === "waiting");
    if (!v || !live || v.stall) stopPlay();  // a stall waits for the user's choice
  }

  $("pool-form").addEventListener("submit", (e) => { e.preventDefault(); newPool(); });
  $("add-form").addEventListener("submit", (e) => {
    e.preventDefault();
    if (!sid) return;
    call("POST", `/api/paged/sessions/${sid}/sequences`, {
      prompt: $("add-prompt").value, max_new: Number($("add-max-new").value),
    });
  });
  $("step").addEventListener("click", () => act("/step"));
  $("play").addEventListener("click", () => {
    if (timer) { stopPlay(); return; }
    $("play").textContent = $("play").dataset.pause;
    timer = setInterval(tick, 700);
    tick();
  });
  $("choose-wait").addEventListener("click", () => act("/wait"));
  newPool();
})();
