/* /docs: start Swagger UI (its bundle comes from the installed fastapi-offline package, not a CDN). */
(function () {
  "use strict";
  const box = document.getElementById("swagger-ui");
  window.SwaggerUIBundle({ url: box.dataset.openapi, dom_id: "#swagger-ui", deepLinking: true });
})();
