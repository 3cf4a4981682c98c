from __future__ import annotations

from django.urls import path

from approvals import policy_views, views

app_name = "approvals"

urlpatterns = [
    path("", views.approval_inbox, name="inbox"),
    path("bulk/", views.approval_bulk, name="bulk"),
    path("<int:approval_id>/", views.approval_detail, name="detail"),
    path("<int:approval_id>/decide/", views.approval_decide_view, name="decide"),
    path("link/<str:token>/", views.approval_link, name="link"),
    path("signed-in/", views.approval_link_after_sign_in, name="link_after_sign_in"),
    # approval policies as data (docs/console.md, "Approval policies")
    path("policies/", policy_views.policy_list, name="policies"),
    path("policies/draft/", policy_views.policy_draft, name="policy_draft"),
    path("policies/<int:policy_id>/", policy_views.policy_detail, name="policy"),
    path(
        "policies/<int:policy_id>/withdraw/",
        policy_views.policy_withdraw_view,
        name="policy_withdraw",
    ),
    path(
        "policies/versions/<int:version_id>/",
        policy_views.version_detail,
        name="policy_version",
    ),
    path(
        "policies/versions/<int:version_id>/simulate/",
        policy_views.version_simulate,
        name="policy_simulate",
    ),
    path(
        "policies/versions/<int:version_id>/publish/",
        policy_views.version_publish,
        name="policy_publish",
    ),
    path(
        "policies/versions/<int:version_id>/discard/",
        policy_views.version_discard,
        name="policy_discard",
    ),
]
