"""Console forms of the scheduler: node actions, enrolment and the estimate ("will this fit")."""

from django import forms

from scheduler.estimation.engines import CACHE_TYPE_BYTES, VLLM_KV_DTYPE_BYTES
from scheduler.models import Accelerator, Node


class NodeActionForm(forms.Form):
    reason = forms.CharField(required=False, max_length=500)


class EnrolForm(forms.Form):
    """An enrolment token: for a new node (its name, or blank: the agent says), or for a registered
    node (a new credential: a node from before enrolment, or one revoked)."""

    name = forms.CharField(required=False, max_length=253, help_text="Blank: the agent says its own name.")
    existing = forms.ModelChoiceField(queryset=Node.objects.all(), required=False, to_field_name="name",
                                      label="Registered node", empty_label="(a new node)",
                                      help_text="Issue a new credential for this node instead.")
    expires_minutes = forms.IntegerField(label="Expires after (minutes)", min_value=1, max_value=7 * 24 * 60,
                                         initial=60)


class NodeLabelsForm(forms.Form):
    """The node's labels as a person writes them: ``key=value``, one a line or separated by commas."""

    labels = forms.CharField(required=False, max_length=20_000, widget=forms.Textarea(attrs={"rows": 3}),
                             help_text="key=value, one a line (e.g. zone=a). What is not listed is removed.")

    def clean_labels(self) -> dict:
        found = {}
        for item in self.cleaned_data["labels"].replace(",", "\n").splitlines():
            item = item.strip()
            if not item:
                continue
            key, equals, value = item.partition("=")
            if not equals:
                raise forms.ValidationError(f"{item!r}: write a label as key=value.", code="invalid_node_labels")
            key, value = key.strip(), value.strip()
            if key in found:
                raise forms.ValidationError(f"{key}: given twice.", code="invalid_node_labels")
            found[key] = value
        return found


class EstimateForm(forms.Form):
    model_path = forms.CharField(label="Model", max_length=4096,
                                 help_text="A .gguf file or a Hugging Face folder under the model directories.")
    engine = forms.ChoiceField(choices=[("llamacpp", "llama.cpp"), ("vllm", "vLLM")], initial="llamacpp")
    node = forms.ModelChoiceField(queryset=Node.objects.all(), required=False, to_field_name="public_id",
                                  empty_label="(no node: estimate only)")
    accelerator = forms.ModelChoiceField(queryset=Accelerator.objects.filter(placeable=True).select_related("node"),
                                         required=False, to_field_name="public_id", empty_label="(the node's memory)")
    ctx_size = forms.IntegerField(label="Context", required=False, min_value=1, max_value=10_000_000,
                                  help_text="llama.cpp --ctx-size / vLLM max_model_len; empty: the model's.")
    parallel = forms.IntegerField(label="Parallel", required=False, min_value=1, max_value=4096, initial=1,
                                  help_text="llama.cpp --parallel / vLLM max_num_seqs.")
    cache_type = forms.ChoiceField(label="KV cache", required=False,
                                   choices=[("", "default")] + [(c, c) for c in CACHE_TYPE_BYTES]
                                   + [(c, c) for c in VLLM_KV_DTYPE_BYTES if c != "auto"])
    n_gpu_layers = forms.IntegerField(label="GPU layers", required=False, min_value=-1, initial=0,
                                      help_text="llama.cpp -ngl: 0 CPU only, -1 all.")

    def engine_values(self) -> dict:
        data = self.cleaned_data
        if data["engine"] == "llamacpp":
            values = {"ctx_size": data.get("ctx_size"), "parallel": data.get("parallel"),
                      "n_gpu_layers": data.get("n_gpu_layers")}
            if data.get("cache_type"):
                values |= {"cache_type_k": data["cache_type"], "cache_type_v": data["cache_type"]}
        else:
            values = {"max_model_len": data.get("ctx_size"), "max_num_seqs": data.get("parallel")}
            if data.get("cache_type"):
                values["kv_cache_dtype"] = data["cache_type"]
        return {k: v for k, v in values.items() if v is not None}
