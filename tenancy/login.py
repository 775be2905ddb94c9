"""The console's login, throttled per account and per address (see ``tenancy.throttle``)."""

from __future__ import annotations

from django import forms
from django.contrib.auth import views as auth_views
from django.contrib.auth.forms import AuthenticationForm

from tenancy.errors import Busy
from tenancy.throttle import login_throttle


class ThrottledAuthenticationForm(AuthenticationForm):
    error_messages = AuthenticationForm.error_messages | {
        "invalid_login": "That user name and password do not match an account.",
        "throttled": "Too many failed logins for this account or address. Try again in %(minutes)s minutes.",
        "busy": "Too many logins are being checked right now; try again in a few seconds.",
    }

    def clean(self):
        username = self.cleaned_data.get("username") or ""
        address = self.request.META.get("REMOTE_ADDR") if self.request else None
        throttle = login_throttle()
        if throttle.blocked(username, address):
            raise forms.ValidationError(self.error_messages["throttled"], code="login_throttled",
                                        params={"minutes": max(1, throttle.retry_after() // 60)})
        try:
            cleaned = super().clean()
        except forms.ValidationError as error:
            if getattr(error, "code", None) == "invalid_login":
                throttle.failed(username, address)
            raise
        except Busy:
            raise forms.ValidationError(self.error_messages["busy"], code="busy") from None
        throttle.succeeded(username, address)
        return cleaned


class LoginView(auth_views.LoginView):
    form_class = ThrottledAuthenticationForm
    redirect_authenticated_user = True
