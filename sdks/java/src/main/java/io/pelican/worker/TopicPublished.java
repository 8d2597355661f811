package io.pelican.worker;

/**
 * Where a message published into a topic went.
 *
 * @param partition its partition
 * @param id its entry id in that partition's stream
 */
public record TopicPublished(int partition, String id) {}
