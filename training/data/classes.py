"""Labels and classes: which labels a run conditions on, checking them (every label a class 0 .. num_classes - 1),
counting classes when data.num_classes is unset, and the classes' ids (WordNet ids, ClassLabel names, a file)
and readable names, kept with the model and written under the validation grids, and what each cell of a
validation grid shows (its class name, or a prompt)."""
import re
from pathlib import Path

import numpy as np

from training.config.config import ConfigError


def labels_are_the_condition(data):
    """Class-conditional training (ImageNet-22k captions from class names count too): the labels must be classes."""
    return bool(data.label_column and (not data.caption_column or data.label_captions))


def label_problem(label, k):
    """Why `label` is not one of the classes 0 .. k - 1 (None when it is one)."""
    if isinstance(label, (bool, str, bytes)) or not isinstance(label, (int, float, np.number)) or label != round(label):
        return f"label {label!r} is not a class index 0, 1, 2, ..."
    if not 0 <= label < k:
        hint = (f"label {k} would train as the guidance null class; 1-based labels: subtract 1, or set "
                f"data.num_classes={k + 1}" if label == k
                else "with more classes, set data.num_classes to their number")
        return f"label {label:g} is not a class 0 .. {k - 1} (data.num_classes={k}; {hint})"
    return None


def class_count(data, ds):
    """(number of classes, where it was read) for an unset data.num_classes: the names of a ClassLabel label
    column (an imagefolder's class folders become one), else the ids of data.class_ids."""
    import datasets

    feature = (ds.features or {}).get(data.label_column)
    if isinstance(feature, datasets.ClassLabel):
        return feature.num_classes, f"the ClassLabel names of column '{data.label_column}'"
    if data.class_ids is not None:
        return len(class_id_list(data, ds)), f"data.class_ids={data.class_ids!r}"
    if isinstance(ds, datasets.IterableDataset):  # a stream: counting its labels would read it all
        raise ValueError(f"data.num_classes is unset and column '{data.label_column}' of the streamed source "
                         f"{data.source} has no class names: set data.num_classes (labels run 0 .. "
                         f"data.num_classes - 1), or data.class_ids to a file with one class name per line")
    labels = ds.with_format("numpy", columns=[data.label_column])[:][data.label_column]
    found = f"; its labels run from {labels.min():g} to {labels.max():g}" if len(labels) else ""
    raise ValueError(f"data.num_classes is unset and column '{data.label_column}' of {data.source} has no class "
                     f"names (it is not a ClassLabel column, nor are there class folders){found}: set "
                     f"data.num_classes, or data.class_ids to a file with one class name per line")


def check_labels(data, ds, split, show=5):
    """Every label of `ds` (split `split` of data.source) must be a class, 0 .. data.num_classes - 1: a larger
    one crashes deep inside torch at the first step (a device-side assert on a GPU), and num_classes itself
    would silently train as the null class of guidance. Raises naming the rows, the range found and a fix; class
    folders (a ClassLabel column) of another count than data.num_classes, naming the folders."""
    class_folders_match(data, ds)
    labels = ds.with_format("numpy", columns=[data.label_column])[:][data.label_column]
    if labels.dtype.kind not in "iuf":
        raise ValueError(f"data.label_column='{data.label_column}' of {data.source} (split '{split}') holds "
                         f"{labels.dtype} values such as {labels[:3].tolist()}, not class indices 0, 1, 2, ...")
    k = data.num_classes
    bad = np.flatnonzero(~((labels >= 0) & (labels < k) & (labels == np.round(labels))))  # NaN: a missing label
    if len(bad) == 0:
        return
    rows = []
    for i in bad[:show].tolist():
        path = (ds[i][data.image_column] or {}).get("path")
        where = "/".join(Path(path).parts[-2:]) if path else ""  # with its folder: every class has a 000.png
        rows.append(f"{i} (label {labels[i]:g}{', ' + where if path else ''})")
    valid = labels[~np.isnan(labels)] if labels.dtype.kind == "f" else labels
    found = f"{valid.min():g} .. {valid.max():g}" if len(valid) else "none (all missing)"
    hint = ""
    if len(valid) and valid.min() == 1 and valid.max() == k:
        hint = (f" They look 1-based: renumber them 0 .. {k - 1} (subtract 1 in your metadata), or set "
                f"data.num_classes={k + 1} and leave class 0 unused.")
    elif len(valid) and valid.max() >= k:
        hint = f" If there are more classes, set data.num_classes={int(valid.max()) + 1}."
    raise ValueError(f"data.label_column='{data.label_column}': {len(bad)} of the {len(labels)} rows of "
                     f"{data.source} (split '{split}') have a label that is not a class 0 .. {k - 1} "
                     f"(data.num_classes={k}; label {k} would train as the guidance null class): rows "
                     f"{', '.join(rows)}{' ...' if len(bad) > show else ''}. The labels found run {found}.{hint}")


def class_folders_match(data, ds):
    """A ClassLabel label column (an imagefolder's class folders, or a dataset's class names) numbers its classes
    0 .. names - 1: a data.num_classes set to another count is refused naming them, before the rows' check or
    read_class_ids would (naming rows, or data.class_ids, which the user never set)."""
    import datasets

    feature = (ds.features or {}).get(data.label_column)
    if not isinstance(feature, datasets.ClassLabel) or data.class_ids is not None:
        return
    if feature.num_classes == data.num_classes:
        return
    names = ", ".join(feature.names[:10]) + (" ..." if feature.num_classes > 10 else "")
    raise ConfigError(f"data.num_classes={data.num_classes}, but {data.source} has {feature.num_classes} classes (its "
                      f"class folders, or the class names of column '{data.label_column}': {names}): set "
                      f"data.num_classes={feature.num_classes}, or leave it unset to read it from them")


def class_id_list(data, ds):
    """The class ids named by data.class_ids (a timm ImageNet subset or a file), or the label column's
    ClassLabel names when it is None; None when there are none."""
    import datasets

    if data.class_ids is None:
        feature = (ds.features or {}).get(data.label_column) if data.label_column else None
        return list(feature.names) if isinstance(feature, datasets.ClassLabel) else None
    if Path(data.class_ids).is_file():
        return Path(data.class_ids).read_text().split()
    from timm.data import ImageNetInfo

    return list(ImageNetInfo(data.class_ids).label_names())


def read_class_ids(data, ds):
    """The WordNet id (or other stable name) of each label index, from the dataset's own metadata, or None.
    `data.class_ids` names a timm ImageNet subset ("imagenet-1k", "imagenet-22k": the synset lists that the
    hub's ImageNet copies are indexed by) or a text file with one id per line; None reads the label column's
    ClassLabel names (an imagefolder of n0xxxxxxx folders holds the WordNet ids there)."""
    ids = class_id_list(data, ds)
    if ids is not None and len(ids) != data.num_classes:
        where = data.class_ids or f"the ClassLabel names of column {data.label_column}"
        raise ValueError(f"data.class_ids: {len(ids)} class ids ({where}) but data.num_classes={data.num_classes}")
    return ids


def class_names(data, ds):
    """Readable class names, the captions of `data.label_captions`."""
    ids = read_class_ids(data, ds)
    if ids is None:
        raise ValueError(f"data.label_captions needs class names: data.label_column='{data.label_column}' is not a "
                         f"ClassLabel column of {data.source}; set data.class_ids (e.g. 'imagenet-22k' or a file)")
    return readable_names(ids)


def readable_names(ids):
    """WordNet ids become their lemmas ("n01440764" -> "tench, Tinca tinca"); other ids are names already, and
    so is a WordNet-like id that ImageNet-22k does not know."""
    if not ids or not all(re.fullmatch(r"n\d{8}", i) for i in ids):
        return list(ids)
    from timm.data import ImageNetInfo

    info = ImageNetInfo("imagenet-22k")
    known = set(info.label_names())
    return [info.label_name_to_description(i) if i in known else i for i in ids]


def validation_prompts(cfg, train_ds, val_ds):
    """What each cell of the validation grid shows, in grid order (also written beside the grid). Text runs:
    the lines of the file val.prompts, else the first held-out captions (label_captions: the held-out rows'
    class names). Class runs: the names of classes 0, 1, 2, ... (cycled), from the data's class names
    (ClassLabel, class folders, data.class_ids), else "class k"."""
    data, n = cfg.data, cfg.val.num_samples
    if cfg.val.prompts is not None:
        if not cfg.encoders.text_encoder:
            raise ValueError(f"val.prompts={cfg.val.prompts!r} is for text-to-image runs (encoders.text_encoder); "
                             f"a class-conditional run's grid shows its classes in order")
        path = Path(cfg.val.prompts)
        if not path.is_file():
            raise FileNotFoundError(f"val.prompts={cfg.val.prompts!r}: no such file (a text file, one prompt per line)")
        prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"val.prompts={cfg.val.prompts!r} holds no prompts (one per line)")
        return prompts[:n]
    if data.label_captions:
        names = class_names(data, train_ds)
        return [names[label] for label in val_ds[:n][data.label_column]]
    if data.caption_column:
        return [str(caption) for caption in val_ds[:n][data.caption_column]]
    ids = read_class_ids(data, train_ds)
    names = readable_names(ids) if ids else [f"class {k}" for k in range(data.num_classes)]
    return [names[k % data.num_classes] for k in range(n)]
