import django_filters

from scheduler.models import Accelerator, CalibrationRecord, Node, PlacementDecision


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


class PlacementDecisionFilterSet(django_filters.FilterSet):
    """Filters the console's placement page and the API's ``/api/scheduler/decisions/`` alike."""

    model = django_filters.CharFilter(label="Model")
    verdict = django_filters.ChoiceFilter(choices=PlacementDecision.Verdict.choices)
    kind = django_filters.ChoiceFilter(choices=PlacementDecision.Kind.choices)

    class Meta:
        model = PlacementDecision
        fields = ["model", "verdict", "kind"]
