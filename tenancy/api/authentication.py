"""Management API keys: ``Authorization: Bearer brk_…`` of a client whose access includes management."""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework import authentication

from tenancy.errors import Forbidden
from tenancy.services import clients


class CredentialAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request):
        header = request.META.get("HTTP_AUTHORIZATION")
        if not header:
            return None  # not ours: the session may still authenticate the caller
        # A BerthError (malformed, unknown, expired, revoked key) renders in the API's error format.
        credential = clients.authenticate(clients.credential_from_header(header))
        if not credential.client.may_manage:
            raise Forbidden("This key is for inference only; management needs a key with management access.")
        return credential.client, credential

    def authenticate_header(self, request):
        return self.keyword


class CredentialAuthenticationScheme(OpenApiAuthenticationExtension):
    """How the schema documents management keys."""

    target_class = CredentialAuthentication
    name = "managementKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "brk_<lookup>_<secret>",
                "description": "A management API key of a service client with management access."}
