import django_filters

from scheduler.models import Accelerator, CalibrationRecord, Node


class NodeFilterSet(django_filters.FilterSet):
    """Filters the console's node list and the API's ``/api/scheduler/nodes/`` alike."""

    q = django_filters.CharFilter(field_name="name", lookup_expr="icontains", label="Name contains")
    state = django_filters.ChoiceFilter(choices=Node.State.choices)

    class Meta:
        model = Node
        fields = ["q", "state"]


class AcceleratorFilterSet(django_filters.FilterSet):
    node = django_filters.UUIDFilter(field_name="node__public_id")
    accelerator_class = django_filters.CharFilter(lookup_expr="iexact", label="Class")
    kind = django_filters.ChoiceFilter(choices=Accelerator.Kind.choices)
    placeable = django_filters.BooleanFilter()

    class Meta:
        model = Accelerator
        fields = ["node", "accelerator_class", "kind", "placeable"]


class CalibrationRecordFilterSet(django_filters.FilterSet):
    model_key = django_filters.CharFilter()
    model_name = django_filters.CharFilter(lookup_expr="icontains")
    engine = django_filters.CharFilter()
    engine_version = django_filters.CharFilter()
    outcome = django_filters.ChoiceFilter(choices=CalibrationRecord.Outcome.choices)

    class Meta:
        model = CalibrationRecord
        fields = ["model_key", "model_name", "engine", "engine_version", "outcome"]
