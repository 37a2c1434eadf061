// The console's only script: live parts without a framework. Pages work without it (every
// figure is rendered by the server; this only refreshes them).
(function () {
  "use strict";
  var HEADERS = { "X-Console-Fetch": "1" };

  // Overview: re-fetch the figures' fragment every few seconds while the tab is visible.
  document.querySelectorAll("[data-refresh]").forEach(function (el) {
    var every = (parseInt(el.getAttribute("data-every"), 10) || 5) * 1000;
    function refresh() {
      if (document.hidden) { return; }
      fetch(el.getAttribute("data-refresh"), { headers: HEADERS, credentials: "same-origin" })
        .then(function (r) {
          if (r.status === 401) { window.location.reload(); return null; }
          return r.ok ? r.text() : null;
        })
        .then(function (html) { if (html !== null) { el.innerHTML = html; } })
        .catch(function () { /* the ledger may be restarting: try again next time */ });
    }
    window.setInterval(refresh, every);
  });

  // An operation that is not at rest: reload once its state or epoch changes.
  document.querySelectorAll("[data-poll-state]").forEach(function (el) {
    var state = el.getAttribute("data-state"), epoch = el.getAttribute("data-epoch");
    function poll() {
      if (document.hidden) { return; }
      fetch(el.getAttribute("data-poll-state"), { headers: HEADERS, credentials: "same-origin" })
        .then(function (r) { return r.ok ? r.json() : null; })
        .then(function (s) {
          if (s && (s.state !== state || String(s.epoch) !== epoch)) { window.location.reload(); }
        })
        .catch(function () {});
    }
    window.setInterval(poll, 1500);
  });

  // Review page: the retry plan only applies to not_executed.
  var plan = document.getElementById("retry-plan");
  if (plan) {
    var radios = document.querySelectorAll("input[name=conclusion]");
    var sync = function () {
      var chosen = document.querySelector("input[name=conclusion]:checked");
      var on = chosen !== null && chosen.value === "not_executed";
      plan.hidden = !on;
      plan.querySelectorAll("input").forEach(function (i) { i.disabled = !on; });
    };
    radios.forEach(function (r) { r.addEventListener("change", sync); });
    sync();
  }
})();
