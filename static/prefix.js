/* /prefix: the page is server-rendered (htmx swaps the result). This script only scrolls the
   "requests side by side" table to where the requests first differ, so a narrow screen shows it. */
window.kv.page("prefix", (page) => {
  "use strict";
  function showFirstDifference(result) {
    const box = result.querySelector("#prefix-align .align-scroll");
    if (!box) return;
    const diffs = [...box.querySelectorAll("td.k-diff")];
    if (!diffs.length) return;
    const head = box.querySelector("th.rowhead");
    const first = Math.min(...diffs.map((td) => td.offsetLeft));
    // Leave a few cells of the shared prefix in view to the left of the first difference.
    box.scrollLeft = Math.max(0, first - (head ? head.offsetWidth : 0) - 8 * diffs[0].offsetWidth);
  }
  page.view("prefix-result", showFirstDifference);
});
