"""Form fields shared by the console's and the approval pages' forms."""

from __future__ import annotations

from django import forms


class UnclippedCharField(forms.CharField):
    """A text field whose length limit only the server checks. Django renders
    ``maxlength`` on the input, and a browser then cuts pasted text at the limit without a
    word (a 2,000-character goal, a 200-character external reference accepted cut short as
    a real resolution): here the form answers with an error naming the limit, and what was
    typed is kept (issue 18)."""

    def widget_attrs(self, widget):
        attrs = super().widget_attrs(widget)
        attrs.pop("maxlength", None)
        return attrs


def choice_field(form: forms.BaseForm, name: str) -> forms.ChoiceField:
    """The form's field ``name``, which is a choice field: for setting its choices when the
    form is made (``form.fields`` holds them as plain ``Field``s)."""
    field = form.fields[name]
    assert isinstance(field, forms.ChoiceField), f"{name} is not a choice field"
    return field
