from django.urls import path

from gateway import views

app_name = "gateway"
urlpatterns = [
    path("", views.IndexView.as_view(), name="index"),
    path("playground/", views.PlaygroundView.as_view(), name="playground"),
    path("splits/", views.SplitSaveView.as_view(), name="split_save"),
    path("splits/<uuid:public_id>/delete/", views.SplitDeleteView.as_view(), name="split_delete"),
]
