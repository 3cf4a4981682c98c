// Time left on pending approvals. Counts down from the server's own figure
// (data-seconds-left, computed at render time) so a skewed client clock does not matter;
// elements swapped in by htmx are picked up on the next tick.
(function () {
  "use strict";
  function format(seconds) {
    if (seconds <= 0) return "expired";
    var d = Math.floor(seconds / 86400);
    var h = Math.floor((seconds % 86400) / 3600);
    var m = Math.floor((seconds % 3600) / 60);
    var s = Math.floor(seconds % 60);
    var pad = function (n) { return (n < 10 ? "0" : "") + n; };
    if (d > 0) return d + "d " + h + "h left";
    if (h > 0) return h + "h " + pad(m) + "m left";
    return m + "m " + pad(s) + "s left";
  }
  function tick() {
    var now = performance.now();
    document.querySelectorAll("time.countdown[data-seconds-left]").forEach(function (el) {
      if (!el.dataset.renderedAt) el.dataset.renderedAt = String(now);
      var left = Number(el.dataset.secondsLeft) - (now - Number(el.dataset.renderedAt)) / 1000;
      el.textContent = format(left);
      el.classList.toggle("soon", left > 0 && left < 300);
      el.classList.toggle("expired", left <= 0);
    });
  }
  tick();
  setInterval(tick, 1000);
})();
