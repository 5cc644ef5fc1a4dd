/* /heads: the table is server-rendered; this script sorts it when a column heading is pressed (high scores
   first, again to reverse; the sort is kept in the URL) and lets a click anywhere on a row follow the row's
   Inspect link, as a click on the link itself does. */
window.kv.page("heads", () => {
  "use strict";
  const kv = window.kv;
  const table = kv.$("heads-table");
  if (!table) return;
  const heads = [...table.querySelectorAll("thead th")];
  const body = table.tBodies[0];

  function sortBy(col, dir) {
    const index = heads.findIndex((th) => th.dataset.col === col);
    if (index < 0) return;
    const sign = dir === "ascending" ? 1 : -1;
    const rows = [...body.rows];
    const value = (tr) => parseFloat(tr.cells[index].dataset.v);
    // Ties keep layer, head order (the first column's value), so a sort is the same every time.
    rows.sort((a, b) => sign * (value(a) - value(b)) || value0(a) - value0(b));
    body.append(...rows);
    heads.forEach((th) => th.removeAttribute("aria-sort"));
    heads[index].setAttribute("aria-sort", dir);
    kv.setQuery({ sort: col, dir: dir === "ascending" ? "asc" : "desc" });
  }
  const value0 = (tr) => parseFloat(tr.cells[0].dataset.v);

  heads.forEach((th) => {
    const button = th.querySelector("button.sort");
    if (!button) return;
    button.addEventListener("click", () => {
      const now = th.getAttribute("aria-sort");
      // A score column starts with its strongest heads; the head column in layer, head order.
      const first = th.dataset.col === "head" || th.dataset.col === "kv" || th.dataset.col === "best" ? "ascending" : "descending";
      sortBy(th.dataset.col, now ? (now === "ascending" ? "descending" : "ascending") : first);
    });
  });

  body.addEventListener("click", (ev) => {
    if (ev.target.closest("a")) return;  // the link does it
    const link = ev.target.closest("tr") && ev.target.closest("tr").querySelector("a[href]");
    if (!link) return;
    if (ev.ctrlKey || ev.metaKey) window.open(link.href, "_blank", "noopener");
    else window.location.assign(link.href);
  });

  const params = new URL(window.location.href).searchParams;
  if (params.get("sort")) sortBy(params.get("sort"), params.get("dir") === "asc" ? "ascending" : "descending");
});
