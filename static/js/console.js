// Small behaviours of the console pages. Everything here is an enhancement: every form
// works without JavaScript (and without this file).
(function () {
  "use strict";

  function rowBoxes(form) {
    // the runs list's boxes (name "run") and the approvals inbox's (name "approval")
    return document.querySelectorAll('input[type="checkbox"][form="' + form.id + '"]:not([data-select-all])');
  }

  function checkedCount(form) {
    var n = 0;
    rowBoxes(form).forEach(function (box) { if (box.checked) n += 1; });
    return n;
  }

  function updateSelection(form) {
    var n = checkedCount(form);
    document.querySelectorAll("[data-selected-count]").forEach(function (el) {
      el.textContent = n ? n + " selected" : "none selected";
    });
    form.querySelectorAll("button[data-needs-selection]").forEach(function (button) {
      button.disabled = n === 0;
    });
  }

  document.addEventListener("change", function (evt) {
    var target = evt.target;
    if (!(target instanceof HTMLInputElement) || target.type !== "checkbox") return;
    var formId = target.getAttribute("form") || target.dataset.selectAll;
    var form = formId && document.getElementById(formId);
    if (!form) return;
    if (target.dataset.selectAll) {
      rowBoxes(form).forEach(function (box) { box.checked = target.checked; });
    }
    updateSelection(form);
  });

  // The runs table and the approvals inbox refresh themselves every few seconds; while the operator has rows
  // selected, the timed refresh waits (it would clear the selection). A refresh that an
  // action asked for (HX-Trigger) still happens.
  document.addEventListener("htmx:beforeRequest", function (evt) {
    var elt = evt.detail.elt;
    if (!elt || !elt.dataset || !elt.dataset.pauseWhileSelected) return;
    var form = document.getElementById(elt.dataset.pauseWhileSelected);
    var triggered = evt.detail.requestConfig && evt.detail.requestConfig.triggeringEvent;
    if (form && !triggered && checkedCount(form) > 0) evt.preventDefault();
  });

  // After a table swap, the selection count starts again from the new rows.
  document.addEventListener("htmx:afterSwap", function () {
    document.querySelectorAll("form[data-bulk]").forEach(updateSelection);
  });

  // Ask before a destructive bulk action (the submitter's data-confirm text).
  document.addEventListener("htmx:confirm", function (evt) {
    var trigger = evt.detail.triggeringEvent;
    var submitter = trigger && trigger.submitter;
    if (!submitter || !submitter.dataset || !submitter.dataset.confirm) return;
    var form = evt.detail.elt;
    var message = submitter.dataset.confirm.replace("{n}", String(checkedCount(form)));
    evt.preventDefault();
    if (window.confirm(message)) evt.detail.issueRequest(true);
  });

  // Start a run: show the input schema of the agent being chosen.
  document.addEventListener("change", function (evt) {
    var target = evt.target;
    if (!(target instanceof HTMLSelectElement) || target.name !== "agent") return;
    document.querySelectorAll("details[data-agent-schema]").forEach(function (details) {
      details.open = details.dataset.agentSchema === target.value;
    });
  });

  document.addEventListener("DOMContentLoaded", function () {
    document.querySelectorAll("form[data-bulk]").forEach(updateSelection);
  });
})();
