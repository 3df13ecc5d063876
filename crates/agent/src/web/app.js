// labsync's page, live: fetches the page's changing part every second and
// swaps it in. No framework; without this file the page refreshes itself
// every 5 s (its <noscript> line).
(function () {
  "use strict";
  var live = document.getElementById("live");
  if (!live) return;
  var src = location.pathname + "?live=1";
  var last = null;
  var tag = null;
  function tick() {
    // With the ETag of what it has: an unchanged page answers 304, no body.
    var headers = tag ? { "If-None-Match": tag } : {};
    fetch(src, { credentials: "same-origin", cache: "no-store", headers: headers })
      .then(function (r) {
        if (r.status === 401) {
          location.href = "/login";
          return null;
        }
        if (r.status === 304) return null;
        if (r.ok) tag = r.headers.get("ETag");
        return r.ok ? r.text() : null;
      })
      .then(function (text) {
        if (text !== null && text !== last) {
          last = text;
          // Kept where it was: a reader scrolled into a log is not thrown back.
          var y = window.scrollY;
          live.innerHTML = text;
          window.scrollTo(0, y);
        }
        document.body.setAttribute("data-updated", String(Date.now()));
      })
      .catch(function () {
        document.body.setAttribute("data-stale", String(Date.now()));
      })
      .then(function () {
        setTimeout(tick, 1000);
      });
  }
  setTimeout(tick, 1000);
})();
