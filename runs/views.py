from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse
from django.shortcuts import render

from runs import selectors


@login_required
def run_list(request: HttpRequest) -> HttpResponse:
    return render(request, "runs/list.html", {"runs": selectors.run_list(limit=200)})
