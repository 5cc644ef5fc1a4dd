/* /prefix: the page is server-rendered (htmx swaps the result). This script only scrolls the
   "requests side by side" table so the first difference is in view on a narrow screen, scrolling no further
   than that: the shared start (the cached blocks) stays visible beside the sticky row labels wherever it fits. */
window.kv.page("prefix", (page) => {
  "use strict";
  function showFirstDifference(result) {
    const box = result.querySelector("#prefix-align .align-scroll");
    if (!box) return;
    const diffs = [...box.querySelectorAll("td.k-diff")];
    if (!diffs.length) return;
    const cell = diffs[0].offsetWidth;
    const left = box.getBoundingClientRect().left - box.scrollLeft;
    const right = Math.min(...diffs.map((td) => td.getBoundingClientRect().right - left));
    // Just far enough that the first difference and two cells after it show at the right edge.
    box.scrollLeft = Math.max(0, right + 2 * cell - box.clientWidth);
  }
  page.view("prefix-result", showFirstDifference);
});
