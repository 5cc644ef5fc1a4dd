/* The guided lesson (?lesson=k): a card beside the page, the stop's live panel outlined and scrolled into view.
   The stops are data from /api/lesson (app/viz/lesson.py): page, target selector, text, and an action made of
   the page's own controls (click, fill, check, uncheck, choose, wait), which this file only interprets. A stop on
   a page whose address a run makes (the zoom page of a long capture) is reached through the page it names as
   "via": there its via steps start the run, and the page that opens keeps ?lesson=k (kv.visit). */
(function () {
  "use strict";
  const kv = window.kv;
  const opened = new URL(window.location.href);
  const first = parseInt(opened.searchParams.get("lesson"), 10);
  if (!first) return;
  // Presenter mode and language given in the URL stay on every page of the lesson (a form the lesson submits
  // may push a URL without them).
  const KEEP = {};
  for (const p of ["present", "lang"]) if (opened.searchParams.has(p)) KEEP[p] = opened.searchParams.get(p);

  let L = null; // the lesson: {stops, labels}
  let at = 0; // the stop shown (1-based)
  let turn = 0; // bumps on every move, so a slow action of an earlier stop does not draw over a newer one
  const done = new Set(); // "once" steps already taken since this page loaded
  const $ = (sel) => { try { return document.querySelector(sel); } catch (e) { return null; } };
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  // A path ending in "/" is a family of pages (/zoom/<key>); any other names one page.
  const here = (stop) => (stop.path.length > 1 && stop.path.endsWith("/")
    ? window.location.pathname.startsWith(stop.path) : window.location.pathname === stop.path);

  async function waitFor(sel, ms) {
    const end = Date.now() + (ms || 60000);
    while (Date.now() < end) {
      const el = $(sel);
      if (el) return el;
      await sleep(100);
    }
    return null;
  }

  async function waitChange(sel, attr, before, ms) {
    const end = Date.now() + (ms || 60000);
    while (Date.now() < end) {
      const el = $(sel);
      if (el && el.getAttribute(attr) !== before) return;
      await sleep(100);
    }
  }

  /* Drive the page's own controls as a learner would, so the page computes and shows its own numbers. */
  async function act(stop, mine, steps, tag) {
    const action = steps || stop.action;
    for (let i = 0; i < action.length; i++) {
      const s = action[i], id = stop.index + (tag || ":") + i;
      if (mine !== turn) return;
      if (s.once && done.has(id)) continue;
      if (s.if && !$(s.if)) continue;
      if (s.unless && $(s.unless)) continue;
      const el = await waitFor(s.sel);
      if (!el || mine !== turn) return;
      const watched = s.changes ? $(s.changes[0]) : null;
      const before = watched ? watched.getAttribute(s.changes[1]) : null;
      if (s.do === "click") el.click();
      else if (s.do === "fill" || s.do === "choose") {
        el.value = s.value;
        el.dispatchEvent(new Event("input", { bubbles: true }));
        el.dispatchEvent(new Event("change", { bubbles: true }));
      } else if (s.do === "check") {
        el.checked = true;
        el.dispatchEvent(new Event("change", { bubbles: true }));
      } else if (s.do === "uncheck") { // every box the selector matches
        document.querySelectorAll(s.sel).forEach((box) => {
          box.checked = false;
          box.dispatchEvent(new Event("change", { bubbles: true }));
        });
      }
      done.add(id);
      if (s.wait) await waitFor(s.wait, s.ms);
      if (s.changes) await waitChange(s.changes[0], s.changes[1], before, s.ms);
    }
  }

  // --- the card --------------------------------------------------------------------------------------
  let card = null;
  function build() {
    const lab = L.labels;
    card = kv.el("aside", { id: "lesson-card", class: "lesson-card", "aria-label": lab.title });
    const head = kv.el("div", { class: "lesson-head" });
    head.append(kv.el("span", { class: "lesson-name" }, lab.title), kv.el("span", { class: "lesson-step", id: "lesson-step" }));
    const exit = kv.el("button", { type: "button", class: "secondary lesson-exit", id: "lesson-exit" }, lab.exit);
    exit.addEventListener("click", leave);
    head.append(exit);
    const nav = kv.el("div", { class: "lesson-nav" });
    const back = kv.el("button", { type: "button", class: "secondary", id: "lesson-back" }, lab.back);
    const next = kv.el("button", { type: "button", id: "lesson-next" }, lab.next);
    back.addEventListener("click", () => go(at - 1));
    next.addEventListener("click", () => (at === L.stops.length ? leave() : go(at + 1)));
    nav.append(back, next);
    const text = kv.el("div", { class: "lesson-text", id: "lesson-text", "aria-live": "polite", tabindex: "0" });
    text.addEventListener("scroll", cue);
    window.addEventListener("resize", cue);
    const more = kv.el("p", { class: "lesson-more", id: "lesson-more", hidden: "" }, "⌄ " + lab.more);
    card.append(head, kv.el("h2", { id: "lesson-title" }), text, more, nav, kv.el("p", { class: "lesson-keys" }, lab.keys));
    document.body.append(card);
    document.body.classList.add("lesson-on");
    // The page has narrowed to make room for the card: charts sized to it when it was drawn (the zoom map) re-fit.
    window.dispatchEvent(new Event("resize"));
  }

  /* Text that does not fit the card scrolls, and says so: a fade and a "more below" mark while any is hidden. */
  function cue() {
    const box = document.getElementById("lesson-text");
    if (!box) return;
    const hidden = box.scrollHeight - box.scrollTop - box.clientHeight > 2;
    box.classList.toggle("more", hidden);
    document.getElementById("lesson-more").hidden = !hidden;
  }

  function fill(stop, line) {
    return line.replace(/\{(\w+)\}/g, (m, name) => {
      if (!(name in stop.fill)) return m;
      const el = $(stop.fill[name]);
      return el && el.textContent.trim() ? el.textContent.trim().replace(/\s+/g, " ") : "—";
    });
  }

  function show(stop, ready) {
    const n = L.stops.length;
    document.getElementById("lesson-step").textContent = L.labels.step.replace("{k}", stop.index).replace("{n}", n);
    document.getElementById("lesson-title").textContent = stop.title;
    const box = document.getElementById("lesson-text");
    const lines = ready === "wait" ? [L.labels.waiting]
      : stop.text.concat(stop.when.filter((w) => $(w.sel)).map((w) => w.text)).map((t) => fill(stop, t));
    if (ready === "missing") lines.push(L.labels.missing);
    box.replaceChildren(...lines.map((t) => kv.el("p", null, t)));
    if (ready === "wait") waiting(box.firstChild);
    box.scrollTop = 0;
    cue();
    document.getElementById("lesson-back").disabled = stop.index === 1;
    document.getElementById("lesson-next").textContent = stop.index === n ? L.labels.finish : L.labels.next;
    card.dataset.step = stop.index;
    card.dataset.ready = ready;
  }

  /* While a stop sets itself up (a capture, a lab's run), the card counts the seconds and repeats what the page's
     own progress line says (its place in line, its layer, its time left from the run's own pace: the lab lines of
     Arena, Patching and Training, the zoom grid's, the long capture's), so a 30 s wait is never a blank card. */
  const PROGRESS = ".lab-line:not([hidden]) .lab-line-text, #zoom-grid-status, #long-status";
  function waiting(line) {
    const start = Date.now(), base = L.labels.waiting, mine = turn;
    const tick = () => {
      if (!line.isConnected || card.dataset.ready !== "wait" || mine !== turn) return;
      const s = Math.round((Date.now() - start) / 1000);
      const said = [...document.querySelectorAll(PROGRESS)].map((el) => el.textContent.trim()).find(Boolean);
      line.textContent = s < 2 ? base : base + " " + L.labels.waited.replace("{s}", s) + (said ? " " + said : "");
      setTimeout(tick, 500);
    };
    setTimeout(tick, 500);
  }

  function spotlight(stop) {
    document.querySelectorAll(".lesson-target").forEach((el) => el.classList.remove("lesson-target"));
    const el = $(stop.target);
    if (!el) return null;
    if (el.tagName === "DETAILS") el.open = true;
    el.classList.add("lesson-target");
    reveal(el);
    return el;
  }

  /* Scroll the panel to the top of the window, below any bar the page keeps stuck there (Decode's run bar). */
  function reveal(el) {
    el.scrollIntoView({ block: "start", behavior: "instant" });
    const r = el.getBoundingClientRect();
    const x = Math.min(Math.max(r.left + 24, 0), window.innerWidth - 1);
    for (let n = document.elementFromPoint(x, Math.max(r.top, 0) + 2); n && n !== document.body; n = n.parentElement) {
      if (el.contains(n)) return;
      const pos = getComputedStyle(n).position;
      if (pos === "sticky" || pos === "fixed") {
        window.scrollBy({ top: -(n.getBoundingClientRect().bottom - r.top + 10), behavior: "instant" });
        return;
      }
    }
  }

  /* The page's URL says the step, so a teacher can link a stop and a reload keeps it. */
  function setUrl(k) {
    kv.setQuery(Object.assign({}, KEEP, { lesson: k || null }));
  }

  /* Another page's stop: go there with the lesson's prompt and model, keeping presenter mode and language. */
  function visit(stop) {
    const there = new URL(stop.url, window.location.origin);
    for (const p in KEEP) there.searchParams.set(p, KEEP[p]);
    window.location.assign(there.toString());
  }

  async function go(k) {
    if (k < 1 || k > L.stops.length) return;
    const stop = L.stops[k - 1];
    if (!here(stop)) { visit(stop); return; }
    const mine = ++turn;
    at = k;
    setUrl(k);
    show(stop, "wait");
    await act(stop, mine);
    if (mine !== turn) return;
    setUrl(k); // a form the action submitted may have pushed a URL of its own
    const el = spotlight(stop);
    show(stop, el ? "ready" : "missing");
    if (el) { // charts drawn after the action can move the panel: look once more
      await sleep(400);
      const r = el.getBoundingClientRect();
      if (mine === turn && (r.top < 0 || r.top > window.innerHeight / 2)) reveal(el);
    }
  }

  function leave() {
    turn++;
    document.querySelectorAll(".lesson-target").forEach((el) => el.classList.remove("lesson-target"));
    if (card) card.remove();
    document.body.classList.remove("lesson-on");
    window.dispatchEvent(new Event("resize"));
    setUrl(null);
  }

  const FIELDS = "input, textarea, select, [contenteditable], [role=listbox], [role=grid], [role=slider], [role=tablist], .token-strip";
  function onKey(e) {
    if (!card || !card.isConnected || e.altKey || e.ctrlKey || e.metaKey || e.shiftKey || e.defaultPrevented) return;
    if (e.target && e.target.closest && e.target.closest(FIELDS)) return; // the field's own arrow keys
    if (e.key === "ArrowRight" && at < L.stops.length) { e.preventDefault(); go(at + 1); }
    else if (e.key === "ArrowLeft" && at > 1) { e.preventDefault(); go(at - 1); }
  }

  async function init() {
    const name = document.getElementById("model-name");
    try {
      L = await kv.getJSON("/api/lesson" + (name ? "?model=" + encodeURIComponent(name.textContent.trim()) : ""));
    } catch (e) { return; } // the message is shown in #error
    const k = Math.min(Math.max(first, 1), L.stops.length);
    const stop = L.stops[k - 1];
    const via = !here(stop) && stop.via && window.location.pathname === stop.via.path;
    if (!here(stop) && !via) { visit(stop); return; }
    build();
    document.addEventListener("keydown", onKey);
    if (via) { // the page that makes this stop's page: start its run, which opens that page (?lesson=k kept)
      at = k;
      show(stop, "wait");
      const mine = ++turn;
      await act(stop, mine, stop.via.action, "via");
      // Still here: the run could not open the stop's page (no engine connected, or it refused). The page's own
      // panel that says so is the stop's, with the sentence that applies.
      if (mine === turn && stop.via.target) {
        const el = spotlight({ target: stop.via.target });
        show(stop, el ? "ready" : "missing");
      }
      return;
    }
    // Reached by a link or a reload: bring the page to this stop's state (the earlier stops' actions here).
    const mine = ++turn;
    show(stop, "wait");
    for (const s of L.stops) {
      if (s.index >= k) break;
      if (s.path === stop.path) await act(s, mine);
    }
    if (mine === turn) go(k);
  }

  document.addEventListener("DOMContentLoaded", init);
})();
