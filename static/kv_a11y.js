/* The keyboard: roving tabindex for groups that are one tab stop, and boxes that scroll joining the tab order
   while they overflow. */
(function () {
  "use strict";
  const kv = (window.kv = window.kv || {});
  /* Roving tabindex: a group that is one tab stop, its items reached with the arrow keys (Home/End too).
     onMove(item) runs when an arrow moves the focus (a listbox selects there; a toolbar does nothing).
     cols(): items per row for ↑/↓ in a two-dimensional group. */
  kv.rovingKeys = function (group, selector, opts) {
    const o = opts || {};
    group.addEventListener("keydown", (e) => {
      const items = [...group.querySelectorAll(selector)];
      const i = items.indexOf(e.target);
      if (i < 0) return;
      const cols = o.cols ? o.cols() : items.length;
      const horiz = o.orientation !== "vertical", vert = o.orientation !== "horizontal";
      let j = null;
      if (e.key === "ArrowRight" && horiz) j = i + 1;
      else if (e.key === "ArrowLeft" && horiz) j = i - 1;
      else if (e.key === "ArrowDown" && vert) j = o.cols ? i + cols : i + 1;
      else if (e.key === "ArrowUp" && vert) j = o.cols ? i - cols : i - 1;
      else if (e.key === "Home") j = 0;
      else if (e.key === "End") j = items.length - 1;
      if (j === null) return;
      e.preventDefault();
      e.stopPropagation();  // the arrows belong to this group here, not to a page-wide shortcut (a lesson's Next/Back)
      j = Math.max(0, Math.min(items.length - 1, j));
      items.forEach((it, k) => it.setAttribute("tabindex", k === j ? "0" : "-1"));
      items[j].focus();
      if (o.onMove) o.onMove(items[j]);
    });
  };
  /* A box that scrolls (a wide table on a phone, a long list) can be scrolled from the keyboard: it joins the
     tab order while, and only while, its content overflows it and nothing inside it is in the tab order.
     Boxes are measured in a ResizeObserver's callback, which the browser runs right after its own layout:
     reading sizes there forces no extra layout (reading them from a timer made the browser lay the page out
     again for each box read). After a change to the page (batched) every box is observed afresh, so it is
     measured once more after the next layout; a box in a panel not laid out yet (content-visibility: auto,
     below the fold) is measured when its panel comes into view and its size changes. */
  const SCROLLERS = "main table, main pre, main ol, main ul, main [class*=scroll], main [class*=wrap], main .formula";
  const MAY_SCROLL = "table, pre, [class*=scroll], .formula";
  const FOCUSABLE = "a[href], button, input, select, textarea, [tabindex]:not([tabindex='-1'])";
  function measureBoxes(entries) {
    const join = [], leave = [];  // all reads first, then the writes
    for (const { target: el } of entries) {
      if (!el.isConnected) continue;
      const own = el.dataset.kvScroll === "1";
      const free = !el.hasAttribute("tabindex") && !el.querySelector(FOCUSABLE);
      const st = getComputedStyle(el);
      const scrolls = (/(auto|scroll)/.test(st.overflowX) && el.scrollWidth > el.clientWidth + 1) ||
        (/(auto|scroll)/.test(st.overflowY) && el.scrollHeight > el.clientHeight + 1);
      if (scrolls && free) join.push(el);
      else if (!scrolls && own) leave.push(el);
    }
    join.forEach((el) => { el.setAttribute("tabindex", "0"); el.dataset.kvScroll = "1"; });
    leave.forEach((el) => { el.removeAttribute("tabindex"); delete el.dataset.kvScroll; });
  }
  const boxes = window.ResizeObserver ? new ResizeObserver(measureBoxes) : null;
  let scrollTimer = null;
  const scrollSoon = () => {  // at most every 150 ms, and surely 150 ms after a change, however busy the page
    if (!scrollTimer && boxes) scrollTimer = setTimeout(() => {
      scrollTimer = null;
      const unseen = [];
      document.querySelectorAll(SCROLLERS).forEach((el) => {
        boxes.unobserve(el);
        boxes.observe(el);
        // Not laid out yet (its panel is below the fold): one that may scroll is reachable until it is measured.
        if (el.checkVisibility && el.checkVisibility() && !el.checkVisibility({ contentVisibilityAuto: true }) &&
            el.matches(MAY_SCROLL) && !el.hasAttribute("tabindex") && !el.querySelector(FOCUSABLE)) unseen.push(el);
      });
      unseen.forEach((el) => { el.setAttribute("tabindex", "0"); el.dataset.kvScroll = "1"; });
    }, 150);
  };
  document.addEventListener("DOMContentLoaded", () => {
    scrollSoon();
    const main = document.querySelector("main");
    if (main && window.MutationObserver) new MutationObserver(scrollSoon).observe(main, { childList: true, subtree: true });
    window.addEventListener("resize", scrollSoon);
  });
})();
