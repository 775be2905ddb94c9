import uuid

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models

slug_validator = RegexValidator(r"^[a-z0-9](?:[a-z0-9-]{0,62}[a-z0-9])?$",
                                "Use 1-64 lower-case letters, digits and inner hyphens.")


class Scope(models.Model):
    """One node of the organisation tree: an organisation, a team in it, or a project in a team.

    ``path`` is the materialised path of slugs (``acme/ml/search``), unique and lower-case: the
    ancestors of a scope are the prefixes of its path and its subtree is everything under
    ``path + "/"``, so "a role holds below" and "holdings sum up the tree" are one indexed query.
    """

    class Kind(models.TextChoices):
        ORG = "org", "Organisation"
        TEAM = "team", "Team"
        PROJECT = "project", "Project"

    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    kind = models.CharField(max_length=8, choices=Kind.choices)
    parent = models.ForeignKey("self", null=True, blank=True, on_delete=models.PROTECT, related_name="children")
    slug = models.CharField(max_length=64, validators=[slug_validator])
    name = models.CharField(max_length=200)
    path = models.CharField(max_length=200, unique=True, editable=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["path"]
        constraints = [
            models.UniqueConstraint(fields=["parent", "slug"], name="unique_slug_among_siblings"),
            models.CheckConstraint(condition=models.Q(kind="org", parent__isnull=True)
                                   | (~models.Q(kind="org") & models.Q(parent__isnull=False)),
                                   name="only_organisations_are_roots"),
        ]
        indexes = [models.Index(fields=["kind", "slug"], name="scope_kind_slug")]

    def __str__(self) -> str:
        return self.written

    @property
    def written(self) -> str:
        """How people write this scope: ``org:acme``, ``team:acme/ml``, ``project:acme/ml/search``."""
        return f"{self.kind}:{self.path}"

    def ancestor_paths(self) -> list[str]:
        """This scope's path and its ancestors', nearest first."""
        parts = self.path.split("/")
        return ["/".join(parts[:i]) for i in range(len(parts), 0, -1)]


class Role(models.TextChoices):
    """Roles rank: each holds what the ones after it hold, and holds for the whole subtree."""

    OWNER = "owner", "Owner"
    ADMIN = "admin", "Admin"
    MEMBER = "member", "Member"
    VIEWER = "viewer", "Viewer"


ROLE_RANK = {Role.VIEWER: 1, Role.MEMBER: 2, Role.ADMIN: 3, Role.OWNER: 4}


class Membership(models.Model):
    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships")
    scope = models.ForeignKey(Scope, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=8, choices=Role.choices)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["scope__path", "user__username"]
        constraints = [models.UniqueConstraint(fields=["user", "scope"], name="one_membership_per_user_and_scope")]

    def __str__(self) -> str:
        return f"{self.user} is {self.role} of {self.scope}"
