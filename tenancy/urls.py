from django.urls import path

from tenancy import views

app_name = "tenancy"
urlpatterns = [
    path("", views.TreeView.as_view(), name="index"),
    path("scopes/<uuid:public_id>/", views.ScopeView.as_view(), name="scope"),
    path("scopes/<uuid:public_id>/children/", views.ScopeCreateView.as_view(), name="scope_create"),
    path("scopes/<uuid:public_id>/contract/", views.ContractView.as_view(), name="contract"),
    path("people/", views.PeopleView.as_view(), name="people"),
    path("people/add/", views.MemberAddView.as_view(), name="member_add"),
    path("memberships/<uuid:public_id>/role/", views.MembershipRoleView.as_view(), name="membership_role"),
    path("memberships/<uuid:public_id>/remove/", views.MembershipRemoveView.as_view(), name="membership_remove"),
    path("clients/", views.ClientListView.as_view(), name="clients"),
    path("clients/new/", views.ClientCreateView.as_view(), name="client_create"),
    path("clients/<uuid:public_id>/", views.ClientView.as_view(), name="client"),
    path("clients/<uuid:public_id>/keys/", views.KeyCreateView.as_view(), name="key_create"),
    path("keys/<uuid:public_id>/revoke/", views.KeyRevokeView.as_view(), name="key_revoke"),
    path("keys/<uuid:public_id>/rotate/", views.KeyRotateView.as_view(), name="key_rotate"),
    path("approvals/", views.ApprovalsView.as_view(), name="approvals"),
    path("approvals/ask/", views.AskApprovalView.as_view(), name="approval_ask"),
    path("approvals/<uuid:public_id>/", views.ApprovalView.as_view(), name="approval"),
    path("approvals/<uuid:public_id>/decide/", views.DecideView.as_view(), name="approval_decide"),
    path("audit/", views.AuditView.as_view(), name="audit"),
    path("audit/export.jsonl", views.AuditExportView.as_view(), name="audit_export"),
]
