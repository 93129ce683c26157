"""`python -m mgpu.allreduce_fit`, as documented: the allreduce fits live in mgpu.selector.allreduce_fit."""

from .selector.allreduce_fit import load_fitted, load_published, main, model_from_dict

__all__ = ["load_fitted", "load_published", "main", "model_from_dict"]

if __name__ == "__main__":
    raise SystemExit(main())
