from django.urls import path

from gateway import views

app_name = "gateway"
urlpatterns = [
    path("", views.IndexView.as_view(), name="index"),
    path("playground/", views.PlaygroundView.as_view(), name="playground"),
    path("splits/", views.SplitSaveView.as_view(), name="split_save"),
    path("splits/<uuid:public_id>/delete/", views.SplitDeleteView.as_view(), name="split_delete"),
    path("batches/", views.BatchesView.as_view(), name="batches"),
    path("batches/<str:public_id>/", views.BatchView.as_view(), name="batch"),
    path("batches/<str:public_id>/cancel/", views.BatchCancelView.as_view(), name="batch_cancel"),
]
