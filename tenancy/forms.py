"""Console forms of the tenancy app.

Forms only read and type what a person typed; the services decide whether it is allowed and
valid (and name the figures when it is not). Choice lists are narrowed to what the caller may see.
"""

from __future__ import annotations

import json
from datetime import timedelta

from django import forms

from tenancy.models import Contract, Role, Scope, ServiceClient
from tenancy.models.contracts import CAPACITY_FIGURES, RATE_FIGURES


class ScopeChoiceField(forms.ModelChoiceField):
    """A scope chosen by its public id, shown as people write it."""

    def __init__(self, queryset, **kwargs):
        super().__init__(queryset, to_field_name="public_id", **kwargs)

    def label_from_instance(self, scope):
        return scope.written


class ScopeCreateForm(forms.Form):
    slug = forms.CharField(max_length=64, help_text="lower-case letters, digits, inner hyphens")
    name = forms.CharField(max_length=200, required=False)


class MemberAddForm(forms.Form):
    username = forms.CharField(max_length=150, label="Person (username)")
    role = forms.ChoiceField(choices=Role.choices, initial=Role.MEMBER)


class RoleForm(forms.Form):
    role = forms.ChoiceField(choices=Role.choices)


class ClientForm(forms.Form):
    project = ScopeChoiceField(Scope.objects.none())
    name = forms.CharField(max_length=100)
    description = forms.CharField(max_length=300, required=False)
    environment = forms.ChoiceField(choices=ServiceClient.Environment.choices,
                                    initial=ServiceClient.Environment.DEVELOPMENT)
    access = forms.ChoiceField(choices=ServiceClient.Access.choices, initial=ServiceClient.Access.INFERENCE)
    priority = forms.ChoiceField(choices=ServiceClient.Priority.choices, initial=ServiceClient.Priority.NORMAL)
    all_models = forms.BooleanField(required=False, label="May call every model")
    allowed_models = forms.CharField(required=False, help_text="model names, comma separated")
    rpm_limit = forms.IntegerField(required=False, min_value=1, label="Requests/min")
    tpm_limit = forms.IntegerField(required=False, min_value=1, label="Tokens/min")
    concurrency_limit = forms.IntegerField(required=False, min_value=1, label="Concurrent requests")

    def __init__(self, *args, projects=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["project"].queryset = projects if projects is not None else Scope.objects.none()

    def clean_allowed_models(self):
        return [name.strip() for name in self.cleaned_data["allowed_models"].split(",") if name.strip()]

    def service_fields(self) -> dict:
        data = dict(self.cleaned_data)
        data.pop("project"), data.pop("name")
        return data


class KeyForm(forms.Form):
    name = forms.CharField(max_length=100, required=False)
    lifetime_days = forms.IntegerField(required=False, min_value=1, max_value=3650, label="Expires after (days)",
                                       help_text="empty: never")
    approval = forms.ChoiceField(required=False, choices=())

    def __init__(self, *args, approvals=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["approval"].choices = [("", "—")] + [(str(a.public_id), f"approved by {a.decided_by} "
                                                           f"({a.reason[:40]})") for a in approvals]
        if not approvals:
            del self.fields["approval"]

    @property
    def lifetime(self) -> timedelta | None:
        days = self.cleaned_data.get("lifetime_days")
        return timedelta(days=days) if days else None


class RotateForm(forms.Form):
    overlap_hours = forms.IntegerField(min_value=0, max_value=30 * 24, initial=24, label="Old key works for (hours)")


def _figure_field(name: str, label: str, decimal: bool) -> forms.Field:
    if decimal:
        return forms.DecimalField(required=False, min_value=0, max_digits=12, decimal_places=2, label=label)
    return forms.IntegerField(required=False, min_value=0, label=label)


class ContractForm(forms.Form):
    """Every figure of a contract; empty means none (the scope adds no guarantee or limit)."""

    approval = forms.ChoiceField(required=False, choices=(), label="Use approval")

    def __init__(self, *args, approvals=(), **kwargs):
        super().__init__(*args, **kwargs)
        for stem, label, unit in CAPACITY_FIGURES:
            suffix = f" ({unit})" if unit else ""
            self.fields[f"{stem}_guarantee"] = _figure_field(stem, f"{label} guarantee{suffix}", True)
            self.fields[f"{stem}_limit"] = _figure_field(stem, f"{label} limit{suffix}", True)
        for stem, label, unit in RATE_FIGURES:
            suffix = f" ({unit})" if unit else ""
            self.fields[stem] = _figure_field(stem, f"{label.capitalize()}{suffix}", False)
        self.fields["budget_mode"] = forms.ChoiceField(choices=Contract.BudgetMode.choices,
                                                       initial=Contract.BudgetMode.HARD)
        self.fields["approval"].choices = [("", "—")] + [
            (str(a.public_id), f"approved by {a.decided_by}: {a.reason[:40]}") for a in approvals]
        self.order_fields([name for name in self.fields if name != "approval"] + ["approval"])
        if not approvals:
            del self.fields["approval"]

    def figures(self) -> dict:
        return {name: value for name, value in self.cleaned_data.items() if name != "approval"}


class AskApprovalForm(forms.Form):
    action = forms.CharField(widget=forms.HiddenInput)
    subject = forms.UUIDField(widget=forms.HiddenInput)
    evidence = forms.CharField(widget=forms.HiddenInput)
    reason = forms.CharField(widget=forms.Textarea(attrs={"rows": 2}), label="Why")

    def clean_evidence(self):
        try:
            return json.loads(self.cleaned_data["evidence"])
        except ValueError:
            raise forms.ValidationError("The evidence is not JSON.") from None


class DecideForm(forms.Form):
    decision = forms.ChoiceField(choices=(("approve", "Approve"), ("reject", "Reject")))
    reason = forms.CharField(required=False, max_length=2000)
