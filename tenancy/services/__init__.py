"""Tenancy's verbs, one module per sub-domain: tree, members, clients, contracts, approvals."""
