/* Numbers for people, as the server writes them: bytes, counts, durations, fixed decimals. */
(function () {
  "use strict";
  const kv = (window.kv = window.kv || {});
  /* Bytes for people: 1,536 → "1.5 KiB" (the same units as the server's |bytes filter). precise: up to two
     decimals, trailing zeros dropped, up to TiB ("57.04 GiB", "2 MiB"): the capacity calculator, whose figures
     are read beside vLLM's log. */
  kv.bytes = function (n, precise) {
    const units = precise ? ["B", "KiB", "MiB", "GiB", "TiB"] : ["B", "KiB", "MiB", "GiB"];
    let i = 0, x = Math.abs(n);
    while (x >= 1024 && i < units.length - 1) { x /= 1024; i++; }
    if (!precise) return (n < 0 ? "-" : "") + (i === 0 ? x.toFixed(0) : x.toFixed(1)) + " " + units[i];
    const s = i === 0 ? x.toFixed(x % 1 ? 2 : 0) : (x >= 100 ? x.toFixed(1) : x.toFixed(2));
    return (n < 0 ? "−" : "") + s.replace(/\.0+$/, "") + " " + units[i];
  };
  /* A count with thousands separators: 467280 → "467,280" (the same in every language, as the server writes it). */
  kv.int = (n) => Math.round(n).toLocaleString("en");
  /* A figure with thousands separators and ``d`` decimals: 26123.134 → "26,123.13" (as kv.int, in every language). */
  kv.dec = (x, d) => Number(x).toLocaleString("en", { minimumFractionDigits: d, maximumFractionDigits: d });
  /* A duration given in seconds, in milliseconds: 0.0123 → "12.3 ms" (two decimals under 10 ms); none → "—". */
  kv.ms = (s) => (s === null || s === undefined ? "—" : (s * 1000).toFixed(s < 0.01 ? 2 : 1) + " ms");
  kv.fmt = function (x, d) {
    if (x === null || x === undefined) return "—";
    if (!isFinite(x)) return x > 0 ? "+∞" : "−∞";
    return Number(x).toFixed(d === undefined ? 4 : d);
  };
})();
