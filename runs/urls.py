from django.urls import path

from runs import views

app_name = "runs"

urlpatterns = [
    path("", views.run_list, name="list"),
    path("questions/", views.question_inbox, name="questions"),
    path("questions/<int:question_id>/", views.question_detail, name="question"),
]
