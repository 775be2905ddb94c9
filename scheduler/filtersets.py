import django_filters

from scheduler.models import Node


class NodeFilterSet(django_filters.FilterSet):
    """Filters the console's node list and the API's ``/api/scheduler/nodes/`` alike."""

    q = django_filters.CharFilter(field_name="name", lookup_expr="icontains", label="Name contains")
    state = django_filters.ChoiceFilter(choices=Node.State.choices)

    class Meta:
        model = Node
        fields = ["q", "state"]
