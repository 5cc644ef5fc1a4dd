// /paged: drives a server-side block pool through /api/paged/... and draws it. User text only via textContent.
window.kv.page("paged", () => {
  "use strict";
  const PALETTE = ["#7fb3ff", "#ffb370", "#8fd694", "#f28fb1", "#c6a4ff", "#ffe071", "#6fd3d3", "#d7b48f"];
  const kv = window.kv, $ = kv.$, t = kv.t;
  const lab = $("paged-lab");
  let sid = null, timer = null, last = null;

  const color = (seq) => PALETTE[seq % PALETTE.length];

  /* Every click is one request, and requests run one at a time, in the order they were clicked: a click made
     while a request is in flight (0.5–2 s on a real model) waits in `queue` and is sent when its turn comes,
     never dropped. #paged-busy shows that work is under way and how many clicks wait. If a request fails, the
     clicks queued behind it are not sent (they may depend on it), and the error message says how many. */
  const queue = [];
  let running = false;

  function showBusy() {
    const b = $("paged-busy");
    b.style.visibility = running ? "visible" : "";  // its room is kept (paged.css): nothing below jumps
    b.textContent = queue.length ? t("js.paged.queued", { n: queue.length }) : b.dataset.working;
    lab.setAttribute("aria-busy", running ? "true" : "false");
  }

  /* Queue `job` (a function returning a promise of the view, or null); resolves with what it returned
     (null when it was never sent). */
  function enqueue(job) {
    return new Promise((resolve) => {
      queue.push({ job, resolve });
      pump();
    });
  }

  async function pump() {
    if (running) { showBusy(); return; }
    const next = queue.shift();
    if (!next) return;
    running = true;
    showBusy();
    let out = null;
    try { out = await next.job(); } finally {
      running = false;
      next.resolve(out);
      showBusy();
      pump();
    }
  }

  /* One request now (its turn has come): draw the answer, or stop and drop what was queued behind it. */
  async function send(method, url, body) {
    try {
      const data = await kv.request(method, url, body);
      kv.clearError();
      render(data);
      return data;
    } catch (e) {
      stopPlay();  // kv.request has shown the message; say what was not sent after it
      const dropped = queue.splice(0);
      dropped.forEach((q) => q.resolve(null));
      const close = document.querySelector("#error .error-box .close");
      if (dropped.length && close) close.before(t("js.paged.dropped", { n: dropped.length }) + " ");
      return null;
    }
  }

  function newPool() {
    stopPlay();
    const model = $("pool-model") ? $("pool-model").value : lab.dataset.model;
    const body = { model, num_blocks: Number($("pool-blocks").value), block_size: Number($("pool-block-size").value) };
    return enqueue(() => send("POST", "/api/paged/sessions", body).then((d) => { if (d) sid = d.session; return d; }));
  }
  /* An action on the pool that is current when its turn comes (a queued reset may have replaced it). */
  const act = (path, body) => enqueue(() => (sid ? send("POST", `/api/paged/sessions/${sid}${path}`, body) : Promise.resolve(null)));

  // --- drawing -------------------------------------------------------------------------------------
  function drawPool(view) {
    const pool = view.pool, before = last ? last.pool.blocks : null;
    $("pool-shape").textContent = t("js.paged.pool_shape", { n: pool.num_blocks, size: pool.block_size, bytes: kv.bytes(pool.bytes_total) });
    const boxes = pool.blocks.map((b, i) => {
      const box = kv.el("div", { class: "blk", "data-block": b.id, "data-ref": b.ref_cnt });
      const head = kv.el("div", null);
      head.append(kv.el("span", { class: "bid" }, "#" + b.id));
      if (b.ref_cnt === 0) {
        box.classList.add("free");
        head.append(kv.el("span", { class: "owner" }, b.free_pos !== null ? t("js.paged.free_pos", { q: b.free_pos }) : t("js.paged.free")));
      } else {
        box.style.background = color(b.owners[0]);
        box.style.borderColor = b.owners.length > 1 ? "" : color(b.owners[0]);
        head.append(kv.el("span", { class: "owner" }, t("js.paged.seq", { id: b.owners.join(", ") })));
        if (pool.groups.length > 1 && b.group !== null) {  // layers differ: say which group's layers this block holds
          box.dataset.kind = pool.groups[b.group].kind;
          head.append(kv.el("span", { class: "grp" }, t("js.paged.group_tag", { g: b.group })));
        }
        if (b.ref_cnt > 1) { box.classList.add("shared"); box.append(kv.el("span", { class: "ref" }, "×" + b.ref_cnt)); }
      }
      box.append(head);
      const slots = kv.el("div", { class: "slots" });
      for (let s = 0; s < pool.block_size; s++) {
        const slot = kv.el("span", { class: "slot" }, s < b.slots.length ? b.slots[s] : "");
        if (b.ref_cnt > 0 && s >= b.filled) { slot.classList.add("waste"); slot.title = t("js.paged.tail_waste"); }
        slots.append(slot);
      }
      box.append(slots);
      box.title = b.ref_cnt ? t("js.paged.block_title", { id: b.id, ref: b.ref_cnt, filled: b.filled, size: pool.block_size })
        : t("js.paged.block_free", { id: b.id });
      if (before && before[i] && (before[i].filled !== b.filled || before[i].ref_cnt !== b.ref_cnt
          || before[i].owners.join() !== b.owners.join())) box.classList.add("flash");
      return box;
    });
    $("pool-map").replaceChildren(...boxes);
    const sum = {
      step: view.step, used: pool.used, free: pool.free, tokens: view.summary.tokens_stored,
      slots: view.summary.slots_reserved, waste: view.summary.tail_waste, cow: pool.cow_copies,
      block_bytes: kv.bytes(pool.bytes_per_block),
    };
    $("pool-summary").querySelectorAll("dd").forEach((dd) => { dd.textContent = sum[dd.dataset.k]; });
    drawGroups(pool);
  }

  // KV-cache groups (a model with sliding-window layers): which layers, their window, the blocks they hold now.
  function drawGroups(pool) {
    const box = $("pool-groups");
    box.hidden = pool.groups.length < 2;
    if (box.hidden) return;
    const items = pool.groups.map((g) => kv.el("li", { "data-kind": g.kind }, g.window === null
      ? t("js.paged.group_full", { g: g.group, layers: g.layers.join(", "), blocks: g.blocks })
      : t("js.paged.group_sliding", { g: g.group, layers: g.layers.join(", "), blocks: g.blocks, window: g.window,
        most: g.most_per_seq, cap: g.cap })));
    items.push(kv.el("li", null, t("js.paged.window_frees", { n: pool.window_frees })));
    $("pool-groups-list").replaceChildren(...items);
  }

  function drawSequences(view) {
    const rows = view.sequences.slice().reverse().map((s) => {
      const tr = kv.el("tr", { class: s.status, "data-seq": s.id });
      const idCell = kv.el("td", null);
      const sw = kv.el("span", { class: "swatch" }); sw.style.background = color(s.id);
      idCell.append(sw, document.createTextNode(s.id + (s.parent !== null ? ` ← ${s.parent}` : "")));
      const st = kv.el("td", { class: "l" }); st.append(kv.el("span", { class: "status " + s.status }, s.status_text));
      if (s.preemptions) st.append(kv.el("div", { class: "explain" }, t("js.paged.preempted", { n: s.preemptions, tokens: s.recomputed_tokens })));
      const txt = kv.el("td", { class: "l txt" });
      txt.append(kv.el("span", null, s.prompt), kv.el("span", { class: "gen" }, s.generated_text));
      if (s.next !== null && (s.status === "running" || s.status === "waiting")) txt.append(kv.el("span", { class: "next" }, s.next));
      const bt = kv.el("td", { class: "l" });
      const chips = (table, into) => table.forEach((b, j) => {
        const chip = kv.el("span", { class: b === null ? "bt freed" : "bt" });
        chip.append(kv.el("small", null, j + "→"), document.createTextNode(b === null ? "–" : b));
        if (b === null) chip.title = t("js.paged.freed_by_window");
        chip.style.borderColor = color(s.id); into.append(chip);
      });
      if (s.group_tables.length) {  // one table per KV-cache group
        s.group_tables.forEach((table, g) => {
          const row = kv.el("div", { class: "gt" }); row.append(kv.el("small", { class: "grp" }, t("js.paged.group_tag", { g })));
          chips(table, row); bt.append(row);
        });
      } else chips(s.block_table, bt);
      const waste = kv.el("td", null, s.block_table.length ? s.tail_waste : "");
      const acts = kv.el("td", { class: "l" });
      if (s.status === "running" || s.status === "waiting") {
        const add = (k, enabled) => {
          const b = kv.el("button", { type: "button", class: "secondary", "data-action": k, disabled: !enabled }, t("js.paged." + k));
          b.addEventListener("click", () => act(`/sequences/${s.id}/${k}`)); acts.append(b);
        };
        add("fork", s.can_fork); add("finish", true); add("cancel", true); add("preempt", s.status === "running");
      }
      tr.append(idCell, st, txt, bt, waste, acts);
      return tr;
    });
    $("seq-table").tBodies[0].replaceChildren(...rows);
    $("seq-empty").hidden = rows.length > 0;
    $("events").replaceChildren(...view.events.slice().reverse().map((e) => kv.el("li", null, e)));
  }

  function drawStall(view) {
    const st = view.stall;
    $("stall").hidden = !st;
    if (!st) return;
    $("stall-what").textContent = st.text;  // the server's sentence, in the page's language
    const running = view.sequences.filter((s) => s.status === "running");
    $("preempt-buttons").replaceChildren(...running.slice().reverse().map((s) => {
      const b = kv.el("button", { type: "button", class: "secondary", "data-preempt": s.id }, t("js.paged.preempt_seq", { id: s.id }));
      b.addEventListener("click", () => act(`/sequences/${s.id}/preempt`));
      return b;
    }));
    const blocked = st.blocked || [];
    $("stall-deadlock").hidden = !(st.kind === "grow" && running.length > 0 && blocked.length === running.length);
  }

  function drawCapacity(view) {
    const cap = view.capacity;
    $("cap-per-token").textContent = kv.bytes(cap.bytes_per_token);
    $("cap-budget").textContent = kv.bytes(cap.budget_bytes);
    $("cap-blocks").tBodies[0].replaceChildren(...cap.by_block_size.map((r) => {
      const tr = kv.el("tr", { class: r.block_size === view.pool.block_size ? "pick" : null, "data-bs": r.block_size });
      [r.block_size, kv.bytes(r.block_bytes), r.num_blocks, kv.int(r.tokens), r.blocks_needed,
       r.waste_slots, r.waste_pct.toFixed(1)].forEach((v) => tr.append(kv.el("td", null, v)));
      return tr;
    }));
    $("cap-formats").tBodies[0].replaceChildren(...cap.by_format.map((r) => {
      const tr = kv.el("tr", null);
      tr.append(kv.el("td", { class: "l" }, r.name), kv.el("td", null, kv.int(r.bytes_per_token)),
                kv.el("td", null, kv.int(r.tokens)));
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
    if (running || queue.length) return;  // a tick is not a click: it waits for the user's clicks to be done
    const v = await act("/step");
    const live = v && v.sequences.some((s) => s.status === "running" || s.status === "waiting");
    if (!v || !live || v.stall) stopPlay();  // a stall waits for the user's choice
  }

  $("pool-form").addEventListener("submit", (e) => { e.preventDefault(); newPool(); });
  $("add-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const body = { prompt: $("add-prompt").value, max_new: Number($("add-max-new").value) };  // as it was clicked
    act("/sequences", body);
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
});
