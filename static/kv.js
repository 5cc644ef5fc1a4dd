/* The core every KVScope page script uses: the page's language and strings, requests to the server (one way to
   fail: the #error banner), kv.page (the one entry point), kv.el, and the page-wide behaviour. The other helpers
   are in their own files, loaded after this one by base.html, each adding to window.kv (no build step):
   kv_format.js (numbers), kv_plot.js (Plotly: loading, layout, phone sizes), kv_a11y.js (keyboard: roving
   tabindex, scroll boxes), kv_colour.js (the weights' colour scales). */
(function () {
  "use strict";
  const kv = (window.kv = window.kv || {});
  let strings = null;
  /* The page's language ("en", "zh"): every request a page makes carries it, so answers match the page. */
  const langMeta = document.querySelector("meta[name=kv-lang]");
  kv.lang = langMeta ? langMeta.content : "en";

  /* A UI string from the server's translation catalog ("js." keys), with {name} placeholders filled. */
  kv.t = function (key, vars) {
    if (strings === null) {
      const el = document.getElementById("i18n-strings");
      strings = el ? JSON.parse(el.textContent) : {};
    }
    if (vars && +vars.n === 1 && strings[key + ".one"]) key += ".one";  // "1 token" beside "{n} tokens"
    const text = strings[key] || key;
    return vars ? text.replace(/\{(\w+)\}/g, (m, name) => (name in vars ? String(vars[name]) : m)) : text;
  };

  kv.b64ToBytes = function (b64) {
    const bin = atob(b64);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  };
  kv.b64ToF32 = function (b64) {
    const bytes = kv.b64ToBytes(b64);
    return new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
  };
  /* The one way pages talk to the JSON API. On an error status the server's message (already in the page's
     language) is shown in #error and the promise rejects with an Error carrying .status; a network failure
     says so the same way. */
  kv.request = async function (method, url, body) {
    let r;
    try {
      r = await fetch(url, body === undefined ? { method, headers: { "X-KVScope-Lang": kv.lang } } : {
        method, headers: { "Content-Type": "application/json", "X-KVScope-Lang": kv.lang }, body: JSON.stringify(body),
      });
    } catch (e) {
      kv.showError(kv.t("js.error.unreachable"));
      throw Object.assign(new Error("unreachable"), { status: 0 });
    }
    let data = null;
    try { data = await r.json(); } catch (e) { data = null; }
    if (!r.ok) {
      const msg = (data && data.detail) || kv.t("js.error.request_failed", { status: r.status });
      kv.showError(msg);
      throw Object.assign(new Error(msg), { status: r.status });
    }
    return data;
  };
  kv.getJSON = (url) => kv.request("GET", url);
  kv.postJSON = (url, body) => kv.request("POST", url, body);
  /* A run followed live (the labs' lines: arena, training): POST body, then the server sends one JSON object per
     line as the run goes (its place in line, its progress, how it ended); onEvent(ev) gets each as it arrives.
     Resolves with the last one. An error status is shown in #error (as kv.request) and rejects. signal: an
     AbortController's; aborting closes the connection, and the server then stops the run. */
  kv.follow = async function (url, body, onEvent, signal) {
    let r;
    try {
      r = await fetch(url, { method: "POST", signal, body: JSON.stringify(body || {}),
        headers: { "Content-Type": "application/json", "X-KVScope-Lang": kv.lang } });
    } catch (e) {
      if (signal && signal.aborted) throw e;
      kv.showError(kv.t("js.error.unreachable"));
      throw Object.assign(new Error("unreachable"), { status: 0 });
    }
    if (!r.ok) {
      let data = null;
      try { data = await r.json(); } catch (e) { data = null; }
      const msg = (data && data.detail) || kv.t("js.error.request_failed", { status: r.status });
      kv.showError(msg);
      throw Object.assign(new Error(msg), { status: r.status });
    }
    const reader = r.body.getReader(), decoder = new TextDecoder();
    let buffered = "", last = null;
    for (;;) {
      const { value, done } = await reader.read();  // rejects when the connection breaks or is aborted
      if (done) break;
      buffered += decoder.decode(value, { stream: true });
      let nl;
      while ((nl = buffered.indexOf("\n")) >= 0) {
        const line = buffered.slice(0, nl).trim();
        buffered = buffered.slice(nl + 1);
        if (line) { last = JSON.parse(line); onEvent(last); }
      }
    }
    return last;
  };
  /* A page's run in a lab's line, followed until it ends (the arena's, patching's): show(text, fraction or null,
     busy) tells each change while isCurrent() (a newer run speaks instead); run.job is set from the stream.
     Resolves with the last event, or null when the stream failed: a lost connection is said in the line, a refusal
     (already in #error) hides the line #lineId. */
  kv.followRun = async function (url, body, run, { show, isCurrent, lineId }) {
    show(kv.t("js.lab.sending"), null, true);
    try {
      return await kv.follow(url, body, (ev) => {
        run.job = ev.job;
        if (isCurrent()) show(ev.text, ev.event === "done" ? 1 : ev.fraction === undefined ? null : ev.fraction,
                              ev.event === "queued" || ev.event === "running");
      }, run.controller.signal);
    } catch (e) {
      if (isCurrent() && !run.controller.signal.aborted && e.status === undefined) show(kv.t("js.lab.lost"), null, false);
      else if (isCurrent() && e.status !== undefined) kv.$(lineId).hidden = true;
      return null;
    }
  };
  kv.clearError = function () { const a = document.getElementById("error"); if (a) a.textContent = ""; };
  /* A user's action that asks the server (a button, a changed field): the last message leaves #error, the
     indicator `busy` (an element's id; optional) shows while it runs, as htmx's hx-indicator does (the
     .htmx-request class), and the answer comes back, or null when it failed (kv.request has shown why). */
  kv.act = async function (method, url, body, busy) {
    kv.clearError();
    const box = busy ? document.getElementById(busy) : null;
    if (box) box.classList.add("htmx-request");
    try {
      return await kv.request(method, url, body);
    } catch (e) {
      return null;
    } finally {
      if (box) box.classList.remove("htmx-request");
    }
  };
  /* Tell the server the page let go of something (a decode session, a run it stopped): nothing to show if that
     fails, the server lets it go by itself in time. */
  kv.forget = (url) => fetch(url, { method: "DELETE", headers: { "X-KVScope-Lang": kv.lang } }).catch(() => null);
  kv.$ = (id) => document.getElementById(id);

  /* The one entry point of every page's script (README, "Front-end page pattern"): kv.page("capacity", start)
     runs start(page) once the document is parsed, and only on that page (<main data-page="capacity">, from the
     route's render(..., page=...)). page.view(id, draw) is how a script draws what the server rendered into
     #id: draw(element) runs now if it is there, and again after every htmx swap that replaces it or changes
     something in it. */
  kv.page = function (name, start) {
    const go = () => {
      const main = document.getElementById("main");
      if (!main || main.dataset.page !== name) return;
      start({
        name, main,
        view(id, draw) {
          const now = document.getElementById(id);
          if (now) draw(now);
          document.addEventListener("htmx:afterSettle", (e) => {
            const el = document.getElementById(id);
            if (el && e.target && (e.target === el || e.target.contains(el) || el.contains(e.target))) draw(el);
          });
        },
      });
    };
    if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", go);
    else go();
  };
  /* The page's state in its address, so a view can be linked and a reload keeps it: each given query parameter
     is set (null or undefined deletes it). push: a new history entry (a run); else the entry is replaced (a sort,
     a selection). */
  kv.setQuery = function (params, push) {
    const u = new URL(window.location.href);
    for (const [k, v] of Object.entries(params)) {
      if (v === null || v === undefined) u.searchParams.delete(k); else u.searchParams.set(k, String(v));
    }
    window.history[push ? "pushState" : "replaceState"](window.history.state, "", u.toString());
  };
  /* Open another page of the app as a run's result (a long capture's zoom page): a guided lesson in progress
     goes along (?lesson=k, and presenter mode and language where this page's address gives them). */
  kv.visit = function (url) {
    const there = new URL(url, window.location.origin), q = new URL(window.location.href).searchParams;
    for (const p of ["lesson", "present", "lang"]) if (q.has(p) && !there.searchParams.has(p)) there.searchParams.set(p, q.get(p));
    window.location.assign(there.toString());
  };
  /* The page's error banner (#error): the message as text, never HTML, with a close button — as the server's
     own error fragment (partials/_error.html) that htmx swaps in there. */
  kv.showError = function (message) {
    const area = document.getElementById("error");
    if (!area) return;
    const close = kv.el("button", { type: "button", class: "close", "data-dismiss": true, "aria-label": kv.t("js.error.dismiss") }, "×");
    area.replaceChildren(kv.el("div", { class: "error-box" }, kv.el("b", null, kv.t("js.error.prefix")), " ", message, " ", close));
  };
  /* One DOM builder for every page: kv.el("td", { class: "l", "data-k": 3 }, text or nodes…). */
  kv.el = function (tag, attrs, ...children) {
    const n = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") n.className = v;
      else if (k === "text") n.textContent = String(v);
      else n.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      n.append(c instanceof Node ? c : String(c));
    }
    return n;
  };
  /* A closed <details> may hold its content in a <template class="on-open">: inert (no style, no layout) until
     the reader opens it. A big page's first layout then covers only what is open. */
  document.addEventListener("toggle", (e) => {
    const d = e.target;
    if (!d.open || !d.querySelectorAll) return;
    d.querySelectorAll(":scope > template.on-open").forEach((t) => t.replaceWith(t.content));
  }, true);
  /* Page-wide behaviour (no inline handlers: the Content-Security-Policy allows no inline script). */
  document.addEventListener("click", function (e) {
    const t = e.target;
    // The page's address may have changed since it was rendered (htmx push, replaceState): go back to where we are now.
    const a = t.closest && t.closest("a[data-lang]");
    if (a) a.href = "/lang/" + a.dataset.lang + "?next=" + encodeURIComponent(location.pathname + location.search);
    const close = t.closest && t.closest("[data-dismiss]");
    if (close && close.parentElement) close.parentElement.remove();
  });
  document.addEventListener("htmx:configRequest", function (e) { e.detail.headers["X-KVScope-Lang"] = kv.lang; });
  // Forms driven entirely by a page script never submit themselves: their buttons act.
  document.addEventListener("submit", function (e) {
    if (e.target.matches && e.target.matches("form[data-no-submit]")) {
      e.preventDefault();
    }
  });
  // A form inside a panel may keep its refusals there, beside its control, rather than in the page-top banner
  // (which may be off-screen): data-error-here="#slot" gets the server's error fragment, and what the form had
  // shown (data-error-clears="#result") is emptied, so no stale result sits under the new, refused input.
  document.addEventListener("htmx:beforeSwap", function (e) {
    const d = e.detail || {};
    const form = d.requestConfig && d.requestConfig.elt && d.requestConfig.elt.closest
      ? d.requestConfig.elt.closest("[data-error-here]") : null;
    if (!form || !d.xhr || d.xhr.status < 400) return;
    const slot = document.querySelector(form.dataset.errorHere);
    if (!slot) return;
    d.target = slot;
    const stale = form.dataset.errorClears && document.querySelector(form.dataset.errorClears);
    if (stale) stale.replaceChildren();
  });
  // A new request from a form that says so clears the previous error message.
  document.addEventListener("htmx:beforeRequest", function (e) {
    const elt = e.detail && e.detail.elt;
    if (elt && elt.closest && elt.closest("[data-clears-error]")) {
      kv.clearError();
    }
  });
})();
