"""Console forms of the serving app."""

import json

from django import forms

from scheduler.models import Node
from serving.models import Deployment


class DeployForm(forms.Form):
    """The deploy wizard. The same fields drive the preview (as one types) and the deploy."""

    name = forms.CharField(max_length=200, help_text="The model name clients will ask for.")
    model_path = forms.CharField(max_length=1024, label="Model file", help_text="A GGUF file under a model directory.")
    node = forms.ModelChoiceField(queryset=Node.objects.all(), to_field_name="name", empty_label=None)
    task = forms.ChoiceField(choices=Deployment.Task.choices)
    engine = forms.ChoiceField(choices=Deployment.Engine.choices)
    runtime = forms.ChoiceField(choices=Deployment.Runtime.choices)
    owner = forms.CharField(required=False, help_text="A project or team, e.g. project:acme/ml/search.")
    priority = forms.IntegerField(min_value=0, max_value=100, initial=50)
    context = forms.IntegerField(min_value=16, required=False, initial=4096, help_text="Context tokens (-c).")
    parallel = forms.IntegerField(min_value=1, max_value=256, required=False, initial=1)
    extra_config = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}),
                                   help_text='More engine settings as JSON, e.g. {"cache_type_k": "q8_0"}.')

    # The plan chosen in the preview (radio buttons there belong to this form): JSON actions.
    actions = forms.CharField(required=False, widget=forms.HiddenInput)

    def clean_actions(self):
        text = self.cleaned_data.get("actions") or ""
        if not text.strip():
            return []
        try:
            value = json.loads(text)
        except ValueError:
            raise forms.ValidationError("The chosen plan could not be read; preview again.") from None
        if not isinstance(value, list):
            raise forms.ValidationError("The chosen plan could not be read; preview again.")
        return value

    def clean_extra_config(self):
        text = self.cleaned_data.get("extra_config") or ""
        if not text.strip():
            return {}
        try:
            value = json.loads(text)
        except ValueError as error:
            raise forms.ValidationError(f"Not JSON: {error}") from None
        if not isinstance(value, dict):
            raise forms.ValidationError("Give a JSON object of settings.")
        return value

    def engine_config(self) -> dict:
        config = dict(self.cleaned_data.get("extra_config") or {})
        for field in ("context", "parallel"):
            if self.cleaned_data.get(field) is not None:
                config[field] = self.cleaned_data[field]
        return config
