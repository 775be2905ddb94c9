"""OpenAI's Files and Batches routes under /v1/ (``berth.asgi`` hands these paths to Django)."""

from django.urls import path

from gateway.batch import views

urlpatterns = [
    path("files", views.files_view, name="v1-files"),
    path("files/<str:file_id>", views.file_view, name="v1-file"),
    path("files/<str:file_id>/content", views.file_content_view, name="v1-file-content"),
    path("batches", views.batches_view, name="v1-batches"),
    path("batches/<str:batch_id>", views.batch_view, name="v1-batch"),
    path("batches/<str:batch_id>/cancel", views.batch_cancel_view, name="v1-batch-cancel"),
]
