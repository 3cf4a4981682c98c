// Panels that refresh themselves — the run page's actions, the unknown-outcomes list — wait
// while the operator is writing in them: a refresh would throw away what they typed or
// close the form they opened. Mark such a panel with data-keep-while-editing. The page
// stays correct without this file: the services refuse a stale action with a message.
(function () {
  "use strict";

  var TEXT = 'textarea, input[type="text"], input[type="number"], input[type="datetime-local"]';

  function editing(panel) {
    var active = document.activeElement;
    if (active && active !== panel && panel.contains(active) && /^(INPUT|TEXTAREA|SELECT)$/.test(active.tagName)) {
      return true;
    }
    var fields = panel.querySelectorAll(TEXT);
    for (var i = 0; i < fields.length; i++) {
      if (fields[i].value !== fields[i].defaultValue) return true;
    }
    var boxes = panel.querySelectorAll('input[type="checkbox"]');
    for (var j = 0; j < boxes.length; j++) {
      if (boxes[j].checked !== boxes[j].defaultChecked) return true;
    }
    return panel.querySelector("details[data-opened-by-user]") !== null;
  }

  // A refresh that waited happens once the operator is done: the panel's hx-trigger
  // includes "refresh-when-idle".
  function catchUp() {
    window.setTimeout(function () {
      document.querySelectorAll("[data-keep-while-editing][data-stale]").forEach(function (panel) {
        if (editing(panel) || !window.htmx) return;
        panel.removeAttribute("data-stale");
        window.htmx.trigger(panel, "refresh-when-idle");
      });
    }, 0);
  }

  // "toggle" does not bubble: listen in the capture phase
  document.addEventListener("toggle", function (evt) {
    var details = evt.target;
    if (!(details instanceof HTMLDetailsElement)) return;
    if (details.open) {
      details.setAttribute("data-opened-by-user", "");
    } else {
      details.removeAttribute("data-opened-by-user");
      catchUp();
    }
  }, true);
  document.addEventListener("focusout", catchUp);

  document.addEventListener("htmx:beforeRequest", function (evt) {
    var elt = evt.detail.elt;
    if (!elt || !elt.hasAttribute || !elt.hasAttribute("data-keep-while-editing")) return;
    if (evt.detail.requestConfig && evt.detail.requestConfig.verb !== "get") return;
    if (editing(elt)) {
      evt.preventDefault();
      elt.setAttribute("data-stale", "");
    }
  });
})();
