// What an application writes against the published package (imported by its name, as a consumer does).
import { Producer, TopicProducer, Worker, done, type Handler } from "@pelican-io/worker";
import { registerWorkerMetrics, type PromClient } from "@pelican-io/worker/prom-client";

export const handler: Handler = async (message) => (message.field("job") ? done() : done());
export const worker = new Worker({ redis: "redis://127.0.0.1:6379", stream: "jobs", group: "workers" });
export const producer = new Producer({ redis: { host: "127.0.0.1", port: 6379 }, stream: "jobs" });
export const metrics = (client: PromClient): void => registerWorkerMetrics(client, [worker]);
export const topic = (): Promise<TopicProducer> => TopicProducer.connect("redis://127.0.0.1:6379", "orders");
