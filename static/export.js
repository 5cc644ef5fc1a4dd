/* Download links on the Inspect page: the head links follow the head currently shown.
   The selection lives in the URL (layer, head, kind) and the trace key on #inspect-view, so the link's
   address is recomputed at click time from those, whatever script changed them. */
(function () {
  "use strict";
  window.kv.page("inspect", () => document.addEventListener("click", function (e) {
    const a = e.target.closest && e.target.closest("a[data-export-head]");
    const view = document.getElementById("inspect-view");
    if (!a || !view) return;
    const p = new URLSearchParams(location.search);
    const layer = p.get("layer") || view.dataset.layer || "0";
    const head = p.get("head") || view.dataset.head || "0";
    const kind = p.get("kind") || view.dataset.kind || "weights";
    a.href = "/api/traces/" + encodeURIComponent(view.dataset.key) + "/export/head/" + encodeURIComponent(layer) +
      "/" + encodeURIComponent(head) + "." + a.dataset.exportHead + "?kind=" + encodeURIComponent(kind);
  }));
})();
