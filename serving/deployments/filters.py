"""The deployments list's filters, one FilterSet for the console's Models page and the API's
``/api/serving/deployments/`` alike."""

import django_filters

from serving.models import Deployment, DeploymentState


class DeploymentFilterSet(django_filters.FilterSet):
    q = django_filters.CharFilter(field_name="name", lookup_expr="icontains", label="Name contains")
    state = django_filters.ChoiceFilter(choices=DeploymentState.choices)
    engine = django_filters.ChoiceFilter(choices=Deployment.Engine.choices)
    node = django_filters.CharFilter(field_name="node__name", label="Node")

    class Meta:
        model = Deployment
        fields = ["q", "state", "engine", "node"]
