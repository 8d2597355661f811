/**
 * One stream entry as the handler sees it. Field names and values are raw bytes, in the order they were added;
 * `pelican-origin-id` and `pelican-deliveries` (on a requeued copy) come last, as the operator wrote them.
 */
export class Message {
  /** `fields`, made when first asked for (a handler that never looks costs no map). */
  private byName: ReadonlyMap<string, Buffer> | undefined;

  constructor(
    readonly id: string,
    /** The raw field/value pairs, in order. */
    readonly pairs: ReadonlyArray<readonly [Buffer, Buffer]>,
  ) {}

  /** Field name (decoded as UTF-8) -> value; the first value when a name repeats. */
  get fields(): ReadonlyMap<string, Buffer> {
    if (!this.byName) {
      const fields = new Map<string, Buffer>();
      for (const [name, value] of this.pairs) {
        const key = name.toString("utf8");
        if (!fields.has(key)) fields.set(key, value);
      }
      this.byName = fields;
    }
    return this.byName;
  }

  /** A field's value as UTF-8 text. */
  field(name: string): string | undefined {
    return this.fields.get(name)?.toString("utf8");
  }

  /** A field's value as bytes. */
  fieldBuffer(name: string): Buffer | undefined {
    return this.fields.get(name);
  }
}
