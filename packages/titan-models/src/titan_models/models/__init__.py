"""The model families. Each subpackage registers its `Family` (see titan_models.registry) when imported;
adding a family is its folder plus one import line here."""
from titan_models.models import deepseek_v3  # noqa: F401
from titan_models.models import deepseek_v4  # noqa: F401
from titan_models.models import gpt_oss  # noqa: F401
from titan_models.models import kimi_k25  # noqa: F401
from titan_models.models import kimi_linear  # noqa: F401
from titan_models.models import llama3  # noqa: F401
from titan_models.models import muse_glimmer  # noqa: F401
from titan_models.models import muse_spark  # noqa: F401
from titan_models.models import qwen3  # noqa: F401
from titan_models.models import qwen3_5  # noqa: F401
from titan_models.models import qwen3_vl  # noqa: F401
from titan_models.models import qwen3_next  # noqa: F401
