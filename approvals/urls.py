from django.urls import path

from approvals import views

app_name = "approvals"

urlpatterns = [
    path("", views.approval_inbox, name="inbox"),
    path("bulk/", views.approval_bulk, name="bulk"),
    path("<int:approval_id>/", views.approval_detail, name="detail"),
    path("<int:approval_id>/decide/", views.approval_decide_view, name="decide"),
    path("link/<str:token>/", views.approval_link, name="link"),
    path("signed-in/", views.approval_link_after_sign_in, name="link_after_sign_in"),
]
