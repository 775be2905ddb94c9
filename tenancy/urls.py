from django.urls import path

from tenancy import views

app_name = "tenancy"
urlpatterns = [
    path("", views.IndexView.as_view(), name="index"),
]
