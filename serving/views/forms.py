"""Console forms of the serving app."""

from __future__ import annotations

import json
from itertools import groupby

from django import forms
from django.urls import reverse

from berth.errors import BerthError
from scheduler.models import Accelerator, Node
from serving.catalog import entries, profiles
from serving.engines.registry import engine_for
from serving.models import Deployment
from serving.views import engine_settings
from tenancy import access


class DeployForm(forms.Form):
    """The deploy wizard. The same fields drive the preview (as one types) and the deploy.

    It starts from a model the mirror holds: picking one (and one of its profiles) fills in its name,
    task, owner and the profile's settings, which stay adjustable; each engine's settings are its own
    declared options (``engine_settings``). A typed file path instead of a held model is offered to
    administrators (accepted from anyone the API would accept it from: the service checks the path)."""

    model = forms.ChoiceField(required=False, label="Held model",
                              help_text="A model the mirror holds (Models → Catalog).")
    profile = forms.ChoiceField(required=False, help_text="How its catalog entry runs it; adjust the settings below.")
    name = forms.CharField(max_length=200, help_text="The model name clients will ask for.")
    model_path = forms.CharField(max_length=1024, required=False, label="Or a file path",
                                 help_text="A GGUF file (or a model folder for vLLM) under a model directory.")
    node = forms.ModelChoiceField(queryset=Node.objects.all(), to_field_name="name", empty_label=None)
    accelerator = forms.ChoiceField(required=False, label="GPU",
                                    help_text="The accelerator it runs on; none: the node's memory and cores.")
    task = forms.ChoiceField(choices=Deployment.Task.choices)
    engine = forms.ChoiceField(choices=Deployment.Engine.choices)
    runtime = forms.ChoiceField(choices=Deployment.Runtime.choices)
    owner = forms.CharField(required=False, help_text="A project or team, e.g. project:acme/ml/search.")
    priority = forms.IntegerField(min_value=0, max_value=100, initial=50)
    context = forms.IntegerField(min_value=16, required=False, initial=4096,
                                 help_text="Context tokens (llama.cpp -c, vLLM --max-model-len).")
    parallel = forms.IntegerField(min_value=1, max_value=4096, required=False, initial=1, label="Slots",
                                  help_text="Requests served at once (llama.cpp --parallel, vLLM --max-num-seqs).")
    extra_config = forms.CharField(required=False, widget=forms.Textarea(attrs={"rows": 2}), label="More settings",
                                   help_text='Any other engine setting as JSON, e.g. {"extra_flags": ["--no-mmap"]}.')

    # The plan chosen in the preview (radio buttons there belong to this form): JSON actions.
    actions = forms.CharField(required=False, widget=forms.HiddenInput)

    def __init__(self, data=None, *, user, initial=None):
        super().__init__(data, initial=initial)
        self.user = user
        self.entry = None
        self.entries = {str(e.public_id): e for e in entries.visible_entries(user).order_by("name")}
        self.fields["model"].choices = [("", "—"), *((key, e.name) for key, e in self.entries.items())]
        chosen = self.entries.get(self["model"].value() or "")
        named = [p.get("name") or "" for p in (chosen.profiles if chosen else [])]
        self.fields["profile"].choices = [(name, name or "(unnamed)") for name in named] or [("", "—")]
        self.fields["accelerator"].choices = accelerator_choices()
        self.fields.update(engine_settings.fields())
        self.may_type_path = access.is_superuser(user)
        # Picking a model or a profile fills the wizard in again for it (``for_entry``), in place.
        for field, sent in (("model", "#id_model"), ("profile", "#id_model, #id_profile")):
            self.fields[field].widget.attrs.update({
                "hx-get": reverse("serving:deploy"), "hx-include": sent, "hx-trigger": "change consume",
                "hx-target": "#deploy-form", "hx-select": "#deploy-form", "hx-swap": "outerHTML"})

    @classmethod
    def for_entry(cls, user, public_id: str, profile: str = "") -> "DeployForm":
        """The wizard filled in for a held model and one of its profiles (the first by default)."""
        form = cls(user=user)
        entry = form.entries.get(public_id)
        if entry is None:
            return form
        chosen = profiles.named(entry, profile or None) or profiles.first(entry)
        kind = profiles.engine(chosen)
        config = profiles.engine_config(chosen)
        if entry.draft:
            try:
                config["draft_model"] = str(entries.draft_path(entry, kind))
            except BerthError:
                pass  # the preview says why the draft cannot be had
        names = engine_for(kind).catalog_keys
        return cls(user=user, initial={
            "model": public_id, "profile": chosen.get("name") or "", "name": entry.name, "task": entry.task,
            "engine": kind, "owner": entry.owner.written if entry.owner else "",
            "priority": int(chosen.get("priority") or 50), "context": config.get(names["context"]),
            "parallel": config.get(names["parallel"]), **engine_settings.initial(kind, config)})

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

    def clean(self):
        data = super().clean()
        self.entry = self.entries.get(data.get("model") or "")
        if self.entry is not None:
            try:
                data["model_path"] = str(entries.served_path(self.entry, data.get("profile") or None))
            except BerthError as error:
                self.add_error("model", error.message)
        elif not data.get("model_path") and "model_path" not in self.errors:
            self.add_error("model", "Pick a model the mirror holds" +
                           (", or give a file path." if self.may_type_path else "."))
        chosen = data.get("accelerator")
        if chosen and data.get("node") is not None:
            data["accelerator"] = Accelerator.objects.select_related("node").filter(public_id=chosen).first()
            if data["accelerator"] is None:
                self.add_error("accelerator", "That accelerator is no longer known; pick another.")
            elif data["accelerator"].node_id != data["node"].pk:
                self.add_error("accelerator", f"{data['accelerator']} is not on {data['node'].name}: "
                                              "pick one of that node's, or another node.")
        else:
            data["accelerator"] = None
        return data

    def engine_config(self) -> dict:
        """What the engine is given: the extra JSON, the common fields in the engine's own keys, then
        the engine's settings."""
        kind = self.cleaned_data["engine"]
        config = dict(self.cleaned_data.get("extra_config") or {})
        names = engine_for(kind).catalog_keys
        for field in ("context", "parallel"):
            if self.cleaned_data.get(field) is not None:
                config[names[field]] = self.cleaned_data[field]
        config.update(engine_settings.read(kind, self.cleaned_data))
        return config

    def place_problems(self, error: BerthError) -> None:
        """A refusal said above the form, and each problem the engine found under its field."""
        self.add_error(None, error.message)
        kind = self.cleaned_data.get("engine") or Deployment.Engine.LLAMACPP
        common = {key: word for word, key in engine_for(kind).catalog_keys.items()}
        found = error.details.get("problems") if isinstance(error.details, dict) else None
        for problem in found or []:
            key = str(problem.get("field", ""))
            field = common.get(key) or engine_settings.field_name(kind, key)
            if field in self.fields and field not in self.errors:
                self.add_error(field, problem.get("message", ""))

    def said_errors(self) -> list[str]:
        """Each problem with the label of its field, as the preview lists them."""
        return [" ".join(errors) if name == "__all__" else f"{self[name].label}: {' '.join(errors)}"
                for name, errors in self.errors.items()]

    def engine_groups(self):
        return engine_settings.groups(self)


def accelerator_choices() -> list:
    """"No GPU", then each node's accelerators (whole cards and MIG instances) grouped by node."""
    found = Accelerator.objects.select_related("node").order_by("node__name", "index", "mig_index")
    choices: list = [("", "No GPU: the node's memory")]
    for node, group in groupby(found, key=lambda a: a.node.name):
        choices.append((node, [(str(a.public_id), _label(a)) for a in group]))
    return choices


def _label(accelerator: Accelerator) -> str:
    where = f"#{accelerator.index}" if accelerator.mig_index is None else \
        f"#{accelerator.index}/{accelerator.mig_index} (MIG {accelerator.profile})"
    size = f", {accelerator.memory_total_bytes / 2**30:.0f} GiB" if accelerator.memory_total_bytes else ""
    state = "" if accelerator.placeable else f" — {accelerator.unplaceable_reason or 'not placeable'}"
    return f"{accelerator.accelerator_class or accelerator.name or 'GPU'} {where}{size}{state}"
