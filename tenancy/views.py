from berth.views import AreaPlaceholderView


class IndexView(AreaPlaceholderView):
    title = "Organisations"
    summary = "Who may do what, with how much: organisations, teams and projects, people and roles, service clients and API keys, capacity contracts, approvals, the audit log."
    coming = (
        "The organisation tree (organisations, teams, projects) and scope resolution",
        "People, memberships and roles; one permission function",
        "Service clients and API keys (shown once, stored hashed)",
        "Capacity contracts: GPU memory, GPUs, cores, request and token rates",
        "Approvals and the audit log",
    )
