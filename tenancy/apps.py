from django.apps import AppConfig


class TenancyConfig(AppConfig):
    """Who may do what, with how much: organisations, teams and projects, people and roles, service clients and API keys, capacity contracts, approvals, the audit log."""

    name = "tenancy"
    verbose_name = "Tenancy"
