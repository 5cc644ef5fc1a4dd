// Behaviour every page shares. It lives here, not inline, so the Content-Security-Policy can forbid inline script.
(function () {
  "use strict";
  // The page's address may have changed since it was rendered (htmx push, replaceState): the language
  // links go back to where we are now.
  document.addEventListener("click", function (e) {
    const a = e.target.closest && e.target.closest("a[data-lang]");
    if (a) a.href = "/lang/" + a.dataset.lang + "?next=" + encodeURIComponent(location.pathname + location.search);
    // The error box's close button.
    const close = e.target.closest && e.target.closest("[data-dismiss]");
    if (close) close.parentElement.remove();
  });
  // Forms driven entirely by a page script never submit themselves.
  document.addEventListener("submit", function (e) {
    if (e.target.matches && e.target.matches("form[data-no-submit]")) e.preventDefault();
  });
  // A new request from a form that says so clears the previous error message.
  document.addEventListener("htmx:beforeRequest", function (e) {
    const elt = e.detail && e.detail.elt;
    if (elt && elt.closest && elt.closest("[data-clears-error]")) {
      const box = document.getElementById("error");
      if (box) box.innerHTML = "";
    }
  });
})();
