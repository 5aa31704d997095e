/* nemo-patch's site: a break opportunity (<wbr>) after each ".", "/", "(", ",", "=", "[" and ":" inside inline
   literals, API signatures and the API's type fields (Sphinx's "span.pre" words; "Type: Optional[a.b.C]"), so that a
   long name such as nemo_patch.engine.post_command.PostCommandResult wraps between its parts on a narrow screen or
   in a narrow table column, never inside an identifier (nemo-patch.css lets those words wrap). Copied text is
   unchanged. */
document.addEventListener("DOMContentLoaded", () => {
  const points = /([./(,=[:])(?=.)/;
  const texts = [];
  const roots = ".bd-content span.pre, .prev-next-area span.pre, dl.field-list > dd > p";
  for (const root of document.querySelectorAll(roots)) {
    for (const node of root.childNodes) {
      if (node.nodeType === Node.TEXT_NODE && points.test(node.data)) texts.push(node);
    }
  }
  for (const node of texts) {
    const pieces = document.createDocumentFragment();
    for (const part of node.data.split(new RegExp(points.source, "g"))) {
      if (!part) continue;
      pieces.append(part);
      if (part.length === 1 && "./(,=[:".includes(part)) pieces.append(document.createElement("wbr"));
    }
    node.replaceWith(pieces);
  }
  // In a signature: after its "(" and after each "=" of a parameter's default (their own elements).
  for (const mark of document.querySelectorAll(".bd-content .sig .sig-paren, .bd-content .sig-param .o")) {
    if (["(", "="].includes(mark.textContent)) mark.after(document.createElement("wbr"));
  }
});
