"""HTML pages for runs. Views stay thin: parse, call a selector or service, render."""

from __future__ import annotations

from django.contrib.auth.decorators import login_required, permission_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render
from django_htmx.middleware import HtmxDetails

from runs import selectors
from runs.models import Run

RUN_LIST_LIMIT = 200


class HtmxHttpRequest(HttpRequest):
    htmx: HtmxDetails


@login_required
@permission_required("runs.view_run", raise_exception=True)
def run_list(request: HtmxHttpRequest) -> HttpResponse:
    status = request.GET.get("status", "")
    if status not in Run.Status.values:
        status = ""  # an unknown filter shows everything rather than an empty page
    counts = selectors.run_status_counts()
    total = sum(counts.values())
    matching = counts[status] if status else total
    context = {
        "runs": selectors.run_list(status=status or None, limit=RUN_LIST_LIMIT),
        "status": status,
        "status_counts": [
            {"status": value, "label": label, "count": counts[value]}
            for value, label in Run.Status.choices
        ],
        "total": total,
        "matching": matching,
        "truncated": matching > RUN_LIST_LIMIT,
        "limit": RUN_LIST_LIMIT,
    }
    # the 3-second refresh asks for the table only
    template = "runs/list.html#runs-table" if request.htmx else "runs/list.html"
    return render(request, template, context)
